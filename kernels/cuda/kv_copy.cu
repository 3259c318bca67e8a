// KV block copy with a device checksum, for GPU-resident KV transfer: copies a list of blocks of one
// layer's block array into a list of blocks of another (a peer's layer mapped through CUDA IPC, or a
// contiguous staging buffer when packing / unpacking for NCCL) and sums the checksum terms of the
// bytes it read. With do_copy == 0 it only reads and sums: the receiver's verification pass.
//
// The checksum of a chunk (defined in kernels/src/cpu/kv_checksum.rs; the CPU and the device agree
// bit for bit): the payload is the chunk's blocks concatenated in list order, N bytes viewed as
// little-endian u64 words w[j]; h_j = fmix64(w[j] ^ (j * KV_WORD_MUL + KV_WORD_ADD)); the checksum
// is (wrapping sum of h_j) ^ N. This kernel accumulates only the wrapping sum, into *checksum with
// warp shuffles, then one atomicAdd per CTA (wrapping addition is associative and commutative, so
// the result does not depend on the schedule); the host applies the xor of N after the download
// (tandem_kernels::cuda::kv_checksum_finish). Zero *checksum before the launch.
//
// Bad ids: a pair whose source id >= src_num_blocks, or (when copying) whose destination id >=
// dst_num_blocks, is skipped entirely (no read, no write) and adds KV_BAD_BLOCK once to the sum in
// place of its words' terms, so the sender's and the receiver's sums disagree.

#define KV_WORD_MUL 0x9E3779B97F4A7C15ull
#define KV_WORD_ADD 0x2545F4914F6CDD1Dull
#define KV_BAD_BLOCK 0x5bd1e9955bd1e995ull
// 16-byte vectors each lane moves per task: a warp task is 32 * KV_UNROLL vectors (2 KiB) of one
// block, all loads of a lane issued before its stores.
#define KV_UNROLL 4
#define KV_TASK_VECS (32 * KV_UNROLL)

// MurmurHash3's 64-bit finaliser: a bijection on u64.
__device__ __forceinline__ u64 kv_fmix64(u64 x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

__device__ __forceinline__ u64 kv_warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Adds the warp's sum of `acc` to *counter (one atomic, from lane 0); every lane must call it.
__device__ __forceinline__ void kv_warp_flush(u64 acc, int lane, u64* counter) {
    acc = kv_warp_sum_u64(acc);
    if (lane == 0 && acc != 0) atomicAdd(counter, acc);
}

// One warp task: vectors [v0, v0 + KV_TASK_VECS) of block `src` (16 bytes per load, every load
// of a lane issued before its stores), stored into block `dst` when it is non-null, and, when
// `sum` is set, the checksum terms of the words read added to `acc`, `j0` being the payload word
// index of the task's first vector (vector v0 + lane holds words j0 + 2 * lane and j0 + 2 * lane + 1).
__device__ __forceinline__ void kv_task(const uint4* __restrict__ src, uint4* __restrict__ dst, int v0, int lane,
                                        int block_vecs, bool sum, u64 j0, u64& acc) {
    uint4 x[KV_UNROLL];
#pragma unroll
    for (int u = 0; u < KV_UNROLL; u++) {
        const int v = v0 + u * 32 + lane;
        if (v < block_vecs) x[u] = src[v];
    }
    if (dst) {
#pragma unroll
        for (int u = 0; u < KV_UNROLL; u++) {
            const int v = v0 + u * 32 + lane;
            if (v < block_vecs) dst[v] = x[u];
        }
    }
    if (sum) {
        // key(j) = j * MUL + ADD for this lane's first word; later vectors step by a constant.
        const u64 k0 = (j0 + 2 * (u64)lane) * KV_WORD_MUL + KV_WORD_ADD;
#pragma unroll
        for (int u = 0; u < KV_UNROLL; u++) {
            const int v = v0 + u * 32 + lane;
            if (v < block_vecs) {
                const u64 k = k0 + (u64)(u * 64) * KV_WORD_MUL;
                const u64 w0 = (u64)x[u].x | ((u64)x[u].y << 32);
                const u64 w1 = (u64)x[u].z | ((u64)x[u].w << 32);
                acc += kv_fmix64(w0 ^ k) + kv_fmix64(w1 ^ (k + KV_WORD_MUL));
            }
        }
    }
}

// For i < n: block src_ids[i] of src -> block dst_ids[i] of dst (when do_copy != 0), 16 bytes per
// load and store; block j of an array is block_vecs * 16 bytes at base + j * block_vecs * 16.
// `checksum` (may be null) receives the sum of the word terms of the bytes read, payload word
// index = i * block_vecs * 2 + (byte offset in the block) / 8. With do_copy == 0, dst and dst_ids
// are not touched (they may be null).
// Grid: any number of CTAs of a multiple of 32 threads (at most 1024); each warp walks the tasks
// (i, slice of KV_TASK_VECS vectors of block i) with a stride of the grid's warp count, so any n
// and block size run on any grid. The launcher checks that both bases are 16-byte aligned and that
// the arrays hold src_num_blocks / dst_num_blocks blocks.
extern "C" __global__ void kv_copy_blocks(const unsigned char* __restrict__ src,
                                          const u32* __restrict__ src_ids, u32 src_num_blocks,
                                          unsigned char* __restrict__ dst,
                                          const u32* __restrict__ dst_ids, u32 dst_num_blocks, int n,
                                          int block_vecs, u64* __restrict__ checksum, int do_copy) {
    const int lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 slices = (u64)((block_vecs + KV_TASK_VECS - 1) / KV_TASK_VECS);
    const u64 tasks = (u64)n * slices;
    const size_t block_bytes = (size_t)block_vecs * 16;
    u64 acc = 0;
    for (u64 t = warp; t < tasks; t += warps) {  // warp-uniform
        const u64 i = t / slices;
        const int v0 = (int)(t - i * slices) * KV_TASK_VECS;
        const u32 sid = src_ids[i];
        const u32 did = do_copy ? dst_ids[i] : 0u;
        if (sid >= src_num_blocks || (do_copy && did >= dst_num_blocks)) {
            if (lane == 0 && v0 == 0) acc += KV_BAD_BLOCK;
            continue;
        }
        kv_task(reinterpret_cast<const uint4*>(src + (size_t)sid * block_bytes),
                do_copy ? reinterpret_cast<uint4*>(dst + (size_t)did * block_bytes) : nullptr, v0, lane, block_vecs,
                checksum != nullptr, i * (u64)block_vecs * 2 + 2 * (u64)v0, acc);
    }
    if (checksum) {  // grid-uniform: every thread reaches the barrier
        __shared__ u64 warp_sums[32];
        acc = kv_warp_sum_u64(acc);
        if (lane == 0) warp_sums[threadIdx.x >> 5] = acc;
        __syncthreads();
        if (threadIdx.x < 32) {
            acc = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0ull;
            acc = kv_warp_sum_u64(acc);
            if (lane == 0 && acc != 0) atomicAdd(checksum, acc);
        }
    }
}

// Several chunks in one launch (segments), each with its own pair of block arrays (one layer of
// each pool) and its own checksum: what a transfer that pipelines several layers enqueues at once.
// `table` holds, as u64: src_base[nseg], dst_base[nseg], start[nseg + 1]; segment s is pairs
// [start[s], start[s+1]) of src_ids / dst_ids (starts strictly increasing from 0); its pair i reads
// block src_ids[i] of the array at src_base[s] and (when do_copy) writes block dst_ids[i] of the
// array at dst_base[s]. checksums[s] (when non-null) receives += the sum of the word terms of
// segment s's bytes read, the payload word index counted from the segment's first pair, exactly
// what kv_copy_blocks gives for that chunk alone; bad ids are skipped and poison their segment's
// sum the same way.
// Grid: any number of CTAs of a multiple of 32 threads; warp w takes the contiguous run of tasks
// [w * per, (w + 1) * per) (a task: KV_TASK_VECS vectors of one block), so it flushes its sum (a
// warp reduction, one atomic) only when its run leaves a segment and at its end.
extern "C" __global__ void kv_copy_segments(const u64* __restrict__ table, int nseg,
                                            const u32* __restrict__ src_ids, u32 src_num_blocks,
                                            const u32* __restrict__ dst_ids, u32 dst_num_blocks,
                                            int block_vecs, u64* __restrict__ checksums, int do_copy) {
    const int lane = threadIdx.x & 31;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64* src_bases = table;
    const u64* dst_bases = table + nseg;
    const u64* starts = table + 2 * (u64)nseg;
    const u64 slices = (u64)((block_vecs + KV_TASK_VECS - 1) / KV_TASK_VECS);
    const u64 tasks = starts[nseg] * slices;
    const u64 per = (tasks + warps - 1) / warps;
    const u64 t0 = warp * per;
    const u64 t1 = min(t0 + per, tasks);
    if (t0 >= t1) return;  // warp-uniform; no barrier below
    const size_t block_bytes = (size_t)block_vecs * 16;
    // The segment of the run's first pair: the last s with starts[s] <= i (warp-uniform search).
    int s = 0;
    {
        const u64 i0 = t0 / slices;
        int lo = 0, hi = nseg - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (starts[mid] <= i0) lo = mid; else hi = mid - 1;
        }
        s = lo;
    }
    u64 acc = 0;
    for (u64 t = t0; t < t1; t++) {  // warp-uniform
        const u64 i = t / slices;
        while (i >= starts[s + 1]) {
            if (checksums) kv_warp_flush(acc, lane, &checksums[s]);
            acc = 0;
            s++;
        }
        const int v0 = (int)(t - i * slices) * KV_TASK_VECS;
        const u32 sid = src_ids[i];
        const u32 did = do_copy ? dst_ids[i] : 0u;
        if (sid >= src_num_blocks || (do_copy && did >= dst_num_blocks)) {
            if (lane == 0 && v0 == 0) acc += KV_BAD_BLOCK;
            continue;
        }
        kv_task(reinterpret_cast<const uint4*>((const unsigned char*)src_bases[s] + (size_t)sid * block_bytes),
                do_copy ? reinterpret_cast<uint4*>((unsigned char*)dst_bases[s] + (size_t)did * block_bytes) : nullptr, v0,
                lane, block_vecs, checksums != nullptr, (i - starts[s]) * (u64)block_vecs * 2 + 2 * (u64)v0, acc);
    }
    if (checksums) kv_warp_flush(acc, lane, &checksums[s]);
}
