// Shared by the attention kernels: the launch parameters and the paged-KV address arithmetic.
//
// The KV cache of one layer is [num_blocks][2 (K, V)][kv_heads][block_size][head_dim] bf16
// (kernels/src/cpu/paged.rs). Key position p of chunk c lives in block
// block_tables[c * max_blocks + p / block_size], slot p % block_size. A table entry that is
// negative or >= num_blocks (padding, or garbage) is never dereferenced: that key is masked.

// Must match `AttnParams` in kernels/src/cuda/attention.rs field for field.
struct AttnParams {
    int num_chunks;
    int max_blocks;
    int num_heads;
    int kv_heads;
    int group;        // num_heads / kv_heads, 1..=16
    int block_size;   // power of two
    int block_shift;  // log2(block_size)
    int num_blocks;
    int q_row_stride; // elements between consecutive q rows
    int q_rows;       // rows of q and out: token indices >= q_rows are ignored
    int num_splits;   // decode only
    int split_keys;   // decode only: keys per split, a multiple of 64
    int head_dim;
    float scale;
};

// Element offset of key position `p`'s K row for KV head `kvh` (the V row is
// `kv_heads * block_size * head_dim` further), or -1 if its block is missing or out of range.
__device__ __forceinline__ long long kv_row_offset(const AttnParams& P, const int* __restrict__ table,
                                                   int p, int kvh, int hd) {
    const int b = p >> P.block_shift;
    if (p < 0 || b >= P.max_blocks) return -1;
    const int id = table[b];
    if (id < 0 || id >= P.num_blocks) return -1;
    const int slot = p & (P.block_size - 1);
    const long long block_elems = 2LL * P.kv_heads * P.block_size * hd;
    return (long long)id * block_elems + ((long long)kvh * P.block_size + slot) * hd;
}
