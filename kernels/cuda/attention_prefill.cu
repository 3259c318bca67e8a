// Prefill attention over the paged KV cache: causal, GQA, flash-attention style on bf16 tensor
// cores (mma.sync m16n8k16, f32 accumulation).
//
// Rows. For one chunk and one KV head, the query rows are the pairs (token t, head g of the KV
// head's group), flattened as r = t * group + g, so one CTA serves every query head that shares
// the K/V it loads (GQA costs no extra KV traffic). A CTA takes PF_BQ = 64 consecutive rows; warp w
// owns rows 16w..16w+15, which is exactly one mma M tile.
//
// Grid (tiles, kv_heads): x enumerates the (chunk, row tile) pairs of the whole batch; each CTA
// finds its chunk by scanning ceil(len_c * group / 64) over the chunks (warp 0, 32 at a time), so
// short and long chunks share one launch with no empty CTAs besides the host's upper bound.
//
// Keys stream in tiles of PF_BK = 64 positions through shared memory (16-byte cp.async from the
// paged blocks; a missing block is zero-filled and masked). Per tile, every warp computes
// S = Q·Kᵀ (16 x 64) with K read by ldmatrix, applies the causal mask (key position <= the row's
// position, and the key's block present), updates its rows' running max and sum (online softmax,
// f32, base-2 exponentials with the scale folded in), and accumulates O += P·V with P converted to
// bf16 straight from the S accumulators (the C fragment layout of two n8 tiles is the A fragment
// layout of one k16 step) and V read by ldmatrix.trans. V's copy is in flight while S is computed.
// Key tiles past the CTA's last row position are never loaded (causal skipping).
//
// Shared rows are padded by 8 bf16 (16 bytes): the 8 row addresses of an ldmatrix or of a
// quarter-warp's 16-byte accesses then fall on distinct bank groups.

#define PF_THREADS 128
#define PF_BQ 64
#define PF_BK 64

__device__ __forceinline__ void ldmatrix_x4(u32& r0, u32& r1, u32& r2, u32& r3, const bf16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32& r0, u32& r1, u32& r2, u32& r3, const bf16* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

// d += a·b for one m16n8k16 tile (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Finds the chunk of row tile `tile` (blockIdx.x): returns the chunk and sets *first_row to the
// tile's first row within the chunk; -1 if the tile is past the batch.
__device__ int prefill_find_chunk(const AttnParams& P, const int* __restrict__ cu_q, int tile, int* first_row) {
    __shared__ int found_chunk, found_row;
    if (threadIdx.x == 0) found_chunk = -1;
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int before = 0;  // tiles of the chunks already scanned
        for (int base = 0; base < P.num_chunks; base += 32) {
            const int c = base + lane;
            int n = 0;
            if (c < P.num_chunks) {
                const int len = max(0, cu_q[c + 1] - cu_q[c]);
                n = (len * P.group + PF_BQ - 1) / PF_BQ;
            }
            int incl = n;  // inclusive scan over the warp
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            const int lo = before + incl - n;
            if (tile >= lo && tile < before + incl) {
                found_chunk = c;
                found_row = (tile - lo) * PF_BQ;
            }
            before += __shfl_sync(0xffffffffu, incl, 31);
            if (tile < before) break;  // warp-uniform: the tile lies in this batch of chunks
        }
    }
    __syncthreads();
    *first_row = found_row;
    return found_chunk;
}

template <int HD>
__device__ void prefill_attention(const AttnParams& P, const bf16* __restrict__ q, const int* __restrict__ cu_q,
                                  const int* __restrict__ start_pos, const int* __restrict__ block_tables,
                                  const bf16* __restrict__ cache, bf16* __restrict__ out) {
    constexpr int ROW = HD + 8;
    constexpr int CHUNKS = HD / 8;
    constexpr int KT = HD / 16;  // k16 steps over the head dim
    constexpr int NT = HD / 8;   // n8 tiles of the output
    const int kvh = blockIdx.y;
    const int G = P.group;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    int row0;
    const int c = prefill_find_chunk(P, cu_q, blockIdx.x, &row0);
    if (c < 0) return;
    const int q_first = cu_q[c];
    const int len = max(0, cu_q[c + 1] - q_first);
    const int sp = start_pos[c];
    const int rows = len * G;
    const int* table = block_tables + (size_t)c * P.max_blocks;

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* Qs = reinterpret_cast<bf16*>(smem);
    bf16* Ks = Qs + PF_BQ * ROW;
    bf16* Vs = Ks + PF_BK * ROW;
    long long* koff = reinterpret_cast<long long*>(Vs + PF_BK * ROW);  // [PF_BK]

    // Q tile -> shared memory (zero rows past the chunk or outside q).
    for (int i = tid; i < PF_BQ * CHUNKS; i += PF_THREADS) {
        const int r = i / CHUNKS, ch = i % CHUNKS;
        const int rr = row0 + r;
        const int t = rr / G, g = rr % G;
        const int tok = q_first + t;
        const bool ok = rr < rows && tok >= 0 && tok < P.q_rows;
        const bf16* src = q + (ok ? (size_t)tok * P.q_row_stride + ((size_t)kvh * G + g) * HD + ch * 8 : 0);
        cp_async16(Qs + r * ROW + ch * 8, src, ok);
    }
    cp_async_commit();

    // This thread's two rows (of the warp's 16): lane/4 and lane/4 + 8. Position -1 masks all keys.
    int pos[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = row0 + warp * 16 + (lane >> 2) + h * 8;
        const int tok = q_first + rr / G;
        pos[h] = (rr < rows && tok >= 0 && tok < P.q_rows) ? sp + rr / G : -1;
    }
    // Keys needed by the CTA: 0 ..= position of its last valid row.
    const int last_row = min(rows, row0 + PF_BQ) - 1;
    const int key_end = sp + last_row / G + 1;

    cp_async_wait<0>();
    __syncthreads();
    u32 qf[KT][4];
#pragma unroll
    for (int kk = 0; kk < KT; kk++)
        ldmatrix_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3],
                    Qs + (warp * 16 + (lane & 15)) * ROW + kk * 16 + (lane >> 4) * 8);

    const float scale_log2 = P.scale * 1.4426950408889634f;
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {T_NEG_INF, T_NEG_INF};  // running max of scaled scores (base 2)
    float l[2] = {0.0f, 0.0f};            // this thread's share of the running sum
    const long long v_shift = (long long)P.kv_heads * P.block_size * HD;

    for (int k0 = 0; k0 < key_end; k0 += PF_BK) {
        __syncthreads();  // previous tile fully consumed
        if (tid < PF_BK) {
            const int p = k0 + tid;
            koff[tid] = p < key_end ? kv_row_offset(P, table, p, kvh, HD) : -1;
        }
        __syncthreads();
        for (int i = tid; i < PF_BK * CHUNKS; i += PF_THREADS) {
            const int r = i / CHUNKS, ch = i % CHUNKS;
            const long long off = koff[r];
            cp_async16(Ks + r * ROW + ch * 8, cache + (off >= 0 ? off : 0) + ch * 8, off >= 0);
        }
        cp_async_commit();
        for (int i = tid; i < PF_BK * CHUNKS; i += PF_THREADS) {
            const int r = i / CHUNKS, ch = i % CHUNKS;
            const long long off = koff[r];
            cp_async16(Vs + r * ROW + ch * 8, cache + (off >= 0 ? off + v_shift : 0) + ch * 8, off >= 0);
        }
        cp_async_commit();
        cp_async_wait<1>();  // K has landed; V may still be in flight
        __syncthreads();

        // S = Q·Kᵀ for this warp's 16 rows and the 64 keys: 8 n8 tiles.
        float s[PF_BK / 8][4];
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
#pragma unroll
            for (int n = 0; n < PF_BK / 8; n += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4(b0, b1, b2, b3,
                            Ks + (n * 8 + (lane & 7) + (lane >> 4) * 8) * ROW + kk * 16 + ((lane >> 3) & 1) * 8);
                mma_bf16(s[n], qf[kk], b0, b1);
                mma_bf16(s[n + 1], qf[kk], b2, b3);
            }
        }

        // Mask, then the online softmax update of this thread's two rows.
        float tile_max[2] = {T_NEG_INF, T_NEG_INF};
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1;
                const int key = n * 8 + (lane & 3) * 2 + (e & 1);
                const int kp = k0 + key;
                const bool ok = kp <= pos[h] && koff[key] >= 0;
                s[n][e] = ok ? s[n][e] * scale_log2 : T_NEG_INF;
                tile_max[h] = fmaxf(tile_max[h], s[n][e]);
            }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
            const float m_new = fmaxf(m[h], tile_max[h]);
            m_use[h] = m_new == T_NEG_INF ? 0.0f : m_new;  // a fully masked row stays at zero
            alpha[h] = exp2f(m[h] - m_use[h]);             // 0 when m = -inf
            m[h] = m_new;
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int n = 0; n < PF_BK / 8; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1;
                s[n][e] = exp2f(s[n][e] - m_use[h]);
                l[h] += s[n][e];
            }
        }
#pragma unroll
        for (int n = 0; n < NT; n++) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }

        cp_async_wait<0>();
        __syncthreads();
        // O += P·V: k16 step j covers keys 16j..16j+15 = S tiles 2j and 2j+1.
#pragma unroll
        for (int j = 0; j < PF_BK / 16; j++) {
            u32 a[4];
            a[0] = pack_bf16x2(s[2 * j][0], s[2 * j][1]);
            a[1] = pack_bf16x2(s[2 * j][2], s[2 * j][3]);
            a[2] = pack_bf16x2(s[2 * j + 1][0], s[2 * j + 1][1]);
            a[3] = pack_bf16x2(s[2 * j + 1][2], s[2 * j + 1][3]);
#pragma unroll
            for (int n = 0; n < NT; n += 2) {
                u32 b0, b1, b2, b3;
                ldmatrix_x4_trans(b0, b1, b2, b3,
                                  Vs + (j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * ROW + n * 8 + (lane >> 4) * 8);
                mma_bf16(o[n], a, b0, b1);
                mma_bf16(o[n + 1], a, b2, b3);
            }
        }
    }

    // Normalise and store: row h of this thread gets o[n][2h], o[n][2h+1] at dims n*8 + (lane%4)*2.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float sum = l[h];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (pos[h] < 0) continue;
        const int rr = row0 + warp * 16 + (lane >> 2) + h * 8;
        const int tok = q_first + rr / G, g = rr % G;
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        bf16* orow = out + (size_t)tok * P.num_heads * HD + ((size_t)kvh * G + g) * HD;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int d = n * 8 + (lane & 3) * 2;
            *reinterpret_cast<u32*>(orow + d) = pack_bf16x2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    prefill_attention_hd64(AttnParams P, const bf16* __restrict__ q, const int* __restrict__ cu_q,
                           const int* __restrict__ start_pos, const int* __restrict__ block_tables,
                           const bf16* __restrict__ cache, bf16* __restrict__ out) {
    prefill_attention<64>(P, q, cu_q, start_pos, block_tables, cache, out);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
    prefill_attention_hd128(AttnParams P, const bf16* __restrict__ q, const int* __restrict__ cu_q,
                            const int* __restrict__ start_pos, const int* __restrict__ block_tables,
                            const bf16* __restrict__ cache, bf16* __restrict__ out) {
    prefill_attention<128>(P, q, cu_q, start_pos, block_tables, cache, out);
}
