// Decode attention over the paged KV cache (flash-decoding): every chunk has exactly one query
// token at position start_pos[c], attending to positions 0..=start_pos[c].
//
// Grid (num_chunks, kv_heads, num_splits), DEC_THREADS threads. A CTA takes one chunk, one KV head
// and one split of DEC_SPLIT keys, and serves all `group` query heads of that KV head, so each K/V
// row is read from memory once per step, not once per query head. It streams its keys in tiles of
// DEC_TILE rows: K and V tiles go global -> shared with 16-byte cp.async copies (consecutive threads
// copy consecutive 16 bytes of a row; a block's rows for one head are contiguous, so the copies
// coalesce), then
//   scores: thread t takes key t % 64 and half the heads; each K chunk is read from shared memory
//           once and used for all its heads (q is in shared memory as f32, pre-scaled);
//   softmax: one warp per head updates the running max m and sum l (online softmax, f32);
//   PV:      thread -> (head, 8 dims, a share of the keys); partial sums stay in registers across
//            tiles and are combined through shared memory at the end of the split.
// The actual context comes from the device metadata, so a CUDA graph captured for a maximum
// context replays for any shorter one: splits past the context write an empty partial (m = -inf).
// With one split the CTA writes the normalised output directly; otherwise it writes
// (m, l, acc[head_dim]) per head to the workspace and decode_reduce combines the splits.

#define DEC_THREADS 128
#define DEC_TILE 64
#define DEC_SPLIT 256  // keys per split: a multiple of DEC_TILE; = DECODE_SPLIT_KEYS in attention.rs
#define MAX_GROUP 16

template <int HD>
struct DecodeSmem {
    static constexpr int ROW = HD + 8;  // padded row: 16-byte accesses of 8 consecutive rows hit distinct banks
    static constexpr int KV_BYTES = DEC_TILE * ROW * 2;
};

template <int HD>
__device__ void decode_attention(const AttnParams& P, const bf16* __restrict__ q, const int* __restrict__ cu_q,
                                 const int* __restrict__ start_pos, const int* __restrict__ block_tables,
                                 const bf16* __restrict__ cache, float* __restrict__ workspace,
                                 bf16* __restrict__ out) {
    constexpr int ROW = DecodeSmem<HD>::ROW;
    constexpr int CHUNKS = HD / 8;          // 16-byte chunks per row
    constexpr int IPT = (MAX_GROUP * CHUNKS + DEC_THREADS - 1) / DEC_THREADS;  // PV items per thread
    const int c = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int G = P.group;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* Ks = reinterpret_cast<bf16*>(smem);
    bf16* Vs = Ks + DEC_TILE * ROW;
    float* qs = reinterpret_cast<float*>(smem + 2 * DecodeSmem<HD>::KV_BYTES);  // [G][HD]
    float* ps = qs + G * HD;                                                     // [G][DEC_TILE]
    float* m_s = ps + G * DEC_TILE;                                              // [G]
    float* l_s = m_s + G;                                                        // [G]
    float* alpha_s = l_s + G;                                                    // [G]
    long long* koff = reinterpret_cast<long long*>(alpha_s + G + 1) ;            // [DEC_TILE]
    koff = reinterpret_cast<long long*>((reinterpret_cast<size_t>(koff) + 7) & ~size_t(7));

    const int q0 = cu_q[c];
    const int tok_ok = (cu_q[c + 1] - q0 == 1) && q0 >= 0 && q0 < P.q_rows;
    if (!tok_ok) return;  // not a decode chunk: nothing to write (the reducer skips it too)
    const int ctx = start_pos[c] + 1;  // keys 0..ctx-1
    const int k_begin = split * DEC_SPLIT;
    const int k_end = min(ctx, k_begin + DEC_SPLIT);
    const size_t part_stride = (size_t)G * (HD + 2);
    float* part = workspace + (((size_t)c * P.kv_heads + kvh) * P.num_splits + split) * part_stride;

    if (k_begin >= k_end) {
        // Empty split: only the max needs writing; the reducer reads nothing else of it.
        if (P.num_splits > 1)
            for (int g = tid; g < G; g += DEC_THREADS) part[g * (HD + 2)] = T_NEG_INF;
        return;
    }

    // q for the group's heads, scaled, as f32.
    const bf16* qrow = q + (size_t)q0 * P.q_row_stride + (size_t)kvh * G * HD;
    for (int i = tid; i < G * HD; i += DEC_THREADS) qs[i] = bf2f(qrow[i]) * P.scale;
    for (int g = tid; g < G; g += DEC_THREADS) {
        m_s[g] = T_NEG_INF;
        l_s[g] = 0.0f;
    }

    // PV work assignment (see the file comment).
    const int items = G * CHUNKS;
    const int parts = items >= DEC_THREADS ? 1 : DEC_THREADS / items;
    const int my_part = parts > 1 ? tid / items : 0;
    float acc[IPT][8];
#pragma unroll
    for (int j = 0; j < IPT; j++)
#pragma unroll
        for (int e = 0; e < 8; e++) acc[j][e] = 0.0f;

    const int* table = block_tables + (size_t)c * P.max_blocks;
    const long long v_shift = (long long)P.kv_heads * P.block_size * HD;

    for (int t0 = k_begin; t0 < k_end; t0 += DEC_TILE) {
        __syncthreads();  // the previous tile's Ks/Vs/ps are no longer read
        if (tid < DEC_TILE) {
            const int p = t0 + tid;
            koff[tid] = p < k_end ? kv_row_offset(P, table, p, kvh, HD) : -1;
        }
        __syncthreads();
        for (int i = tid; i < DEC_TILE * CHUNKS; i += DEC_THREADS) {
            const int r = i / CHUNKS, ch = i % CHUNKS;
            const long long off = koff[r];
            const bf16* src = cache + (off >= 0 ? off : 0) + ch * 8;
            cp_async16(Ks + r * ROW + ch * 8, src, off >= 0);
            cp_async16(Vs + r * ROW + ch * 8, src + (off >= 0 ? v_shift : 0), off >= 0);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        // Scores: thread -> key tid % 64, heads tid / 64, tid / 64 + 2, ...
        {
            const int key = tid & (DEC_TILE - 1);
            const int g0 = tid / DEC_TILE;
            constexpr int GPT = MAX_GROUP / (DEC_THREADS / DEC_TILE);  // heads per thread, at most
            float s[GPT];
#pragma unroll
            for (int j = 0; j < GPT; j++) s[j] = 0.0f;
            const bf16* krow = Ks + key * ROW;
#pragma unroll 4
            for (int ch = 0; ch < CHUNKS; ch++) {
                float kf[8];
                unpack8(*reinterpret_cast<const uint4*>(krow + ch * 8), kf);
#pragma unroll
                for (int j = 0; j < GPT; j++) {
                    const int g = g0 + j * (DEC_THREADS / DEC_TILE);
                    if (g < G) {
                        const float4 a = *reinterpret_cast<const float4*>(qs + g * HD + ch * 8);
                        const float4 b = *reinterpret_cast<const float4*>(qs + g * HD + ch * 8 + 4);
                        s[j] += kf[0] * a.x + kf[1] * a.y + kf[2] * a.z + kf[3] * a.w + kf[4] * b.x +
                                kf[5] * b.y + kf[6] * b.z + kf[7] * b.w;
                    }
                }
            }
            const bool valid = koff[key] >= 0;
#pragma unroll
            for (int j = 0; j < GPT; j++) {
                const int g = g0 + j * (DEC_THREADS / DEC_TILE);
                if (g < G) ps[g * DEC_TILE + key] = valid ? s[j] : T_NEG_INF;
            }
        }
        __syncthreads();

        // Online softmax: warp w updates heads w, w + 4, ...
        for (int g = warp; g < G; g += DEC_THREADS / 32) {
            const float a = ps[g * DEC_TILE + lane], b = ps[g * DEC_TILE + lane + 32];
            const float tile_max = warp_max(fmaxf(a, b));
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, tile_max);
            // All keys so far masked: keep everything at zero without computing -inf - -inf.
            const float m_use = m_new == T_NEG_INF ? 0.0f : m_new;
            const float pa = expf(a - m_use), pb = expf(b - m_use);
            ps[g * DEC_TILE + lane] = pa;
            ps[g * DEC_TILE + lane + 32] = pb;
            const float sum = warp_sum(pa + pb);
            if (lane == 0) {
                const float alpha = expf(m_old - m_use);  // 0 when m_old = -inf
                alpha_s[g] = alpha;
                l_s[g] = l_s[g] * alpha + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();

        // PV.
#pragma unroll
        for (int j = 0; j < IPT; j++) {
            const int item = parts > 1 ? tid % items : tid + j * DEC_THREADS;
            if (item >= items || (parts > 1 && (j > 0 || my_part >= parts))) continue;
            const int g = item / CHUNKS, ch = item % CHUNKS;
            const float alpha = alpha_s[g];
#pragma unroll
            for (int e = 0; e < 8; e++) acc[j][e] *= alpha;
            const float* prow = ps + g * DEC_TILE;
            for (int key = my_part; key < DEC_TILE; key += parts) {
                const float p = prow[key];
                float vf[8];
                unpack8(*reinterpret_cast<const uint4*>(Vs + key * ROW + ch * 8), vf);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[j][e] += p * vf[e];
            }
        }
    }
    __syncthreads();

    // Combine the key partitions (parts > 1) through shared memory (the K tile is free now).
    float* red = reinterpret_cast<float*>(smem);  // [parts][items][8]
    if (parts > 1) {
        if (my_part < parts) {
            const int item = tid % items;
#pragma unroll
            for (int e = 0; e < 8; e++) red[((size_t)my_part * items + item) * 8 + e] = acc[0][e];
        }
        __syncthreads();
        if (tid < items) {
            for (int pp = 1; pp < parts; pp++)
#pragma unroll
                for (int e = 0; e < 8; e++) acc[0][e] += red[((size_t)pp * items + tid) * 8 + e];
        }
    }
#pragma unroll
    for (int j = 0; j < IPT; j++) {
        const int item = tid + j * DEC_THREADS;
        if (item >= items || (parts > 1 && j > 0)) continue;
        const int g = item / CHUNKS, ch = item % CHUNKS;
        if (P.num_splits == 1) {
            const float l = l_s[g];
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            float o[8];
#pragma unroll
            for (int e = 0; e < 8; e++) o[e] = acc[j][e] * inv;
            bf16* orow = out + (size_t)q0 * P.num_heads * HD + ((size_t)kvh * G + g) * HD;
            *reinterpret_cast<uint4*>(orow + ch * 8) = pack8(o);
        } else {
            float* dst = part + g * (HD + 2);
            if (ch == 0) {
                dst[0] = m_s[g];
                dst[1] = l_s[g];
            }
#pragma unroll
            for (int e = 0; e < 8; e++) dst[2 + ch * 8 + e] = acc[j][e];
        }
    }
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS)
    decode_attention_hd64(AttnParams P, const bf16* __restrict__ q, const int* __restrict__ cu_q,
                          const int* __restrict__ start_pos, const int* __restrict__ block_tables,
                          const bf16* __restrict__ cache, float* __restrict__ workspace, bf16* __restrict__ out) {
    decode_attention<64>(P, q, cu_q, start_pos, block_tables, cache, workspace, out);
}

extern "C" __global__ void __launch_bounds__(DEC_THREADS)
    decode_attention_hd128(AttnParams P, const bf16* __restrict__ q, const int* __restrict__ cu_q,
                           const int* __restrict__ start_pos, const int* __restrict__ block_tables,
                           const bf16* __restrict__ cache, float* __restrict__ workspace, bf16* __restrict__ out) {
    decode_attention<128>(P, q, cu_q, start_pos, block_tables, cache, workspace, out);
}

// Combines the splits' partials: grid (num_chunks, num_heads), head_dim threads (one per dim).
// out = Σ_s acc_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M) with M = max_s m_s; splits with m_s = -inf
// (empty, or every key masked) are skipped without reading their acc; l = 0 gives zeros.
extern "C" __global__ void decode_reduce(AttnParams P, const int* __restrict__ cu_q,
                                         const float* __restrict__ workspace, bf16* __restrict__ out) {
    const int c = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    const int HD = P.head_dim, G = P.group;
    const int q0 = cu_q[c];
    if (cu_q[c + 1] - q0 != 1 || q0 < 0 || q0 >= P.q_rows || d >= HD) return;
    const int kvh = head / G, g = head % G;
    const size_t part_stride = (size_t)G * (HD + 2);
    const float* base = workspace + ((size_t)c * P.kv_heads + kvh) * P.num_splits * part_stride + (size_t)g * (HD + 2);
    float M = T_NEG_INF;
    for (int s = 0; s < P.num_splits; s++) M = fmaxf(M, base[s * part_stride]);
    float L = 0.0f, o = 0.0f;
    if (M != T_NEG_INF) {
        for (int s = 0; s < P.num_splits; s++) {
            const float* pp = base + s * part_stride;
            const float m = pp[0];
            if (m == T_NEG_INF) continue;
            const float w = expf(m - M);
            L += pp[1] * w;
            o += pp[2 + d] * w;
        }
    }
    out[(size_t)q0 * P.num_heads * HD + (size_t)head * HD + d] = f2bf(L > 0.0f ? o / L : 0.0f);
}
