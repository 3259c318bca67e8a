// Decode attention over the paged KV cache (flash-decoding on bf16 tensor cores): every chunk has
// exactly one query token at position start_pos[c], attending to positions 0..=start_pos[c].
//
// Grid (num_chunks, kv_heads, num_splits), DEC_THREADS = 4 warps. A CTA takes one chunk, one KV
// head and one split of P.split_keys keys (the launcher picks the split so the grid fills the
// GPU), and serves all `group` query heads of that KV head, so each K/V row is read from memory
// once per step, not once per query head.
//
// The group's query heads are the rows of one mma M tile (m16n8k16, rows >= group are zero), so
// a 16-key step is S = Q·Kᵀ (head_dim/16 mma pairs) and O += P·V (head_dim/8 mmas) with P taken
// straight from the S accumulators, as in the prefill kernel. The tensor cores leave the SM's
// issue slots to the memory pipeline; the scalar version of this kernel was issue-bound at about
// 2.1 TB/s on an H100.
//
// Each warp works alone on keys k_begin + 16w, + 64, + 128, ... of the split, with its own running
// max/sum/accumulators (online softmax, base-2 with the scale folded in) and its own two-stage
// shared-memory pipeline: while it computes on one 16-key group, the next group's K and V rows
// are in flight (16-byte cp.async; lane i resolves key i's paged address once and the warp shares
// it by shuffles). No barrier is needed until the end, where the 4 warps' states are combined
// through shared memory. With one split the CTA writes the normalised output; otherwise it writes
// (m, l, acc[head_dim]) per head, m in natural-log units, and decode_reduce combines the splits.
// The actual context comes from the device metadata, so a CUDA graph captured for a maximum
// context replays for any shorter one: splits past the context write an empty partial (m = -inf).

#define DEC_THREADS 128
#define DEC_WARPS 4
#define DEC_KEYS 16   // keys per warp step (one k16 step of P·V)
#define DEC_STAGES 2

template <int HD>
struct DecodeSmem {
    static constexpr int ROW = HD + 8;                       // padded row, as in the prefill kernel
    static constexpr int MAT = DEC_KEYS * ROW;               // bf16 of one K or V group
    static constexpr int WARP = DEC_STAGES * 2 * MAT;        // bf16 per warp
    static constexpr int BYTES = DEC_WARPS * WARP * 2;       // = decode_smem() in attention.rs
    static constexpr int COMBINE = DEC_WARPS * 16 * (HD + 2) * 4;
    static_assert(COMBINE <= BYTES, "the combine step reuses the pipeline buffers");
};

// Starts the copies of keys kb..kb+15 (K and V rows of KV head kvh) into K/V; returns the mask of
// the keys that exist (bit i: key kb + i is < k_end and its block is present). Missing rows are
// zero-filled. Warp-collective.
template <int HD>
__device__ __forceinline__ u32 decode_load_group(const AttnParams& P, const int* __restrict__ table,
                                                 const bf16* __restrict__ cache, int kb, int k_end, int kvh,
                                                 bf16* K, bf16* V, int lane) {
    constexpr int ROW = HD + 8, CHUNKS = HD / 8;
    const int p = kb + (lane & 15);
    const long long off = p < k_end ? kv_row_offset(P, table, p, kvh, HD) : -1;
    const u32 valid = __ballot_sync(0xffffffffu, off >= 0) & 0xffffu;
    const int lo = (int)(unsigned long long)off, hi = (int)((unsigned long long)off >> 32);
    const long long v_shift = (long long)P.kv_heads * P.block_size * HD;
#pragma unroll
    for (int i = 0; i < DEC_KEYS * CHUNKS / 32; i++) {
        const int idx = i * 32 + lane;
        const int r = idx / CHUNKS, ch = idx % CHUNKS;
        const long long o = (long long)(((unsigned long long)(u32)__shfl_sync(0xffffffffu, hi, r) << 32) |
                                        (u32)__shfl_sync(0xffffffffu, lo, r));
        const bool ok = o >= 0;
        cp_async16(K + r * ROW + ch * 8, cache + (ok ? o : 0) + ch * 8, ok);
        cp_async16(V + r * ROW + ch * 8, cache + (ok ? o + v_shift : 0) + ch * 8, ok);
    }
    return valid;
}

template <int HD>
__device__ void decode_attention(const AttnParams& P, const bf16* __restrict__ q, const int* __restrict__ cu_q,
                                 const int* __restrict__ start_pos, const int* __restrict__ block_tables,
                                 const bf16* __restrict__ cache, float* __restrict__ workspace,
                                 bf16* __restrict__ out) {
    constexpr int ROW = DecodeSmem<HD>::ROW;
    constexpr int KT = HD / 16;  // k16 steps over the head dim
    constexpr int NT = HD / 8;   // n8 tiles of the output
    const int c = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int G = P.group;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    extern __shared__ __align__(16) unsigned char smem[];

    const int q0 = cu_q[c];
    const int tok_ok = (cu_q[c + 1] - q0 == 1) && q0 >= 0 && q0 < P.q_rows;
    if (!tok_ok) return;  // not a decode chunk: nothing to write (the reducer skips it too)
    const int ctx = start_pos[c] + 1;  // keys 0..ctx-1
    const int k_begin = split * P.split_keys;
    const int k_end = min(ctx, k_begin + P.split_keys);
    const size_t part_stride = (size_t)G * (HD + 2);
    float* part = workspace + (((size_t)c * P.kv_heads + kvh) * P.num_splits + split) * part_stride;

    if (k_begin >= k_end) {
        // Empty split: only the max needs writing; the reducer reads nothing else of it.
        if (P.num_splits > 1)
            for (int g = tid; g < G; g += DEC_THREADS) part[g * (HD + 2)] = T_NEG_INF;
        return;
    }

    // This thread's rows of the M tile (query heads of the group) and its column pair.
    const int r0 = lane >> 2, r1 = r0 + 8, kc = (lane & 3) * 2;
    // Q's A fragments straight from global memory (rows >= G are zero).
    const bf16* qbase = q + (size_t)q0 * P.q_row_stride + (size_t)kvh * G * HD;
    u32 qf[KT][4];
#pragma unroll
    for (int kk = 0; kk < KT; kk++) {
        const int col = kk * 16 + kc;
        qf[kk][0] = r0 < G ? *reinterpret_cast<const u32*>(qbase + r0 * HD + col) : 0u;
        qf[kk][1] = r1 < G ? *reinterpret_cast<const u32*>(qbase + r1 * HD + col) : 0u;
        qf[kk][2] = r0 < G ? *reinterpret_cast<const u32*>(qbase + r0 * HD + col + 8) : 0u;
        qf[kk][3] = r1 < G ? *reinterpret_cast<const u32*>(qbase + r1 * HD + col + 8) : 0u;
    }

    const float scale_log2 = P.scale * 1.4426950408889634f;
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m[2] = {T_NEG_INF, T_NEG_INF};  // running max of scaled scores (base 2), rows r0 and r1
    float l[2] = {0.0f, 0.0f};            // this thread's share of the running sums

    const int* table = block_tables + (size_t)c * P.max_blocks;
    bf16* wbuf = reinterpret_cast<bf16*>(smem) + warp * DecodeSmem<HD>::WARP;
    const int first = k_begin + warp * DEC_KEYS;
    constexpr int STRIDE = DEC_WARPS * DEC_KEYS;
    const int groups = first < k_end ? (k_end - first + STRIDE - 1) / STRIDE : 0;

    u32 mask_next = 0;
    if (groups > 0)
        mask_next = decode_load_group<HD>(P, table, cache, first, k_end, kvh, wbuf, wbuf + DecodeSmem<HD>::MAT, lane);
    cp_async_commit();
    for (int it = 0; it < groups; it++) {
        const u32 mask = mask_next;
        bf16* Ks = wbuf + (it & 1) * 2 * DecodeSmem<HD>::MAT;
        const bf16* Vs = Ks + DecodeSmem<HD>::MAT;
        if (it + 1 < groups) {
            bf16* Kn = wbuf + ((it + 1) & 1) * 2 * DecodeSmem<HD>::MAT;
            mask_next = decode_load_group<HD>(P, table, cache, first + (it + 1) * STRIDE, k_end, kvh, Kn,
                                              Kn + DecodeSmem<HD>::MAT, lane);
        }
        cp_async_commit();
        cp_async_wait<1>();  // this group has landed; the next one may still be in flight
        __syncwarp();

        // S = Q·Kᵀ: rows = query heads, columns = the 16 keys (two n8 tiles).
        float s[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KT; kk++) {
            u32 b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3, Ks + ((lane & 7) + (lane >> 4) * 8) * ROW + kk * 16 + ((lane >> 3) & 1) * 8);
            mma_bf16(s[0], qf[kk], b0, b1);
            mma_bf16(s[1], qf[kk], b2, b3);
        }

        // Mask, then the online softmax update of this thread's two rows.
        float tile_max[2] = {T_NEG_INF, T_NEG_INF};
#pragma unroll
        for (int n = 0; n < 2; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int key = n * 8 + kc + (e & 1);
                s[n][e] = (mask >> key) & 1u ? s[n][e] * scale_log2 : T_NEG_INF;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
            }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
            const float m_new = fmaxf(m[h], tile_max[h]);
            m_use[h] = m_new == T_NEG_INF ? 0.0f : m_new;  // all keys so far masked: stay at zero
            alpha[h] = exp2f(m[h] - m_use[h]);             // 0 when m = -inf
            m[h] = m_new;
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int n = 0; n < 2; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[n][e] = exp2f(s[n][e] - m_use[e >> 1]);
                l[e >> 1] += s[n][e];
            }
        }
        // O = O·alpha + P·V (the C layout of the two S tiles is the A layout of one k16 step).
        u32 a[4];
        a[0] = pack_bf16x2(s[0][0], s[0][1]);
        a[1] = pack_bf16x2(s[0][2], s[0][3]);
        a[2] = pack_bf16x2(s[1][0], s[1][1]);
        a[3] = pack_bf16x2(s[1][2], s[1][3]);
#pragma unroll
        for (int n = 0; n < NT; n += 2) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
            o[n + 1][0] *= alpha[0];
            o[n + 1][1] *= alpha[0];
            o[n + 1][2] *= alpha[1];
            o[n + 1][3] *= alpha[1];
            u32 b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3, Vs + ((lane & 7) + ((lane >> 3) & 1) * 8) * ROW + n * 8 + (lane >> 4) * 8);
            mma_bf16(o[n], a, b0, b1);
            mma_bf16(o[n + 1], a, b2, b3);
        }
        __syncwarp();  // the next iteration's copies overwrite this stage
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }

    // Combine the warps: [warp][row] (m, l), then [warp][row][HD] accumulators, over the buffers.
    __syncthreads();
    float* cm = reinterpret_cast<float*>(smem);
    float* co = cm + DEC_WARPS * 16 * 2;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = h ? r1 : r0;
        if (row >= G) continue;
        if ((lane & 3) == 0) {
            cm[(warp * 16 + row) * 2] = m[h];
            cm[(warp * 16 + row) * 2 + 1] = l[h];
        }
        float* dst = co + (warp * 16 + row) * HD + kc;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            dst[n * 8] = o[n][2 * h];
            dst[n * 8 + 1] = o[n][2 * h + 1];
        }
    }
    __syncthreads();
    for (int i = tid; i < G * HD; i += DEC_THREADS) {
        const int g = i / HD, d = i % HD;
        float M = T_NEG_INF;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) M = fmaxf(M, cm[(w * 16 + g) * 2]);
        float L = 0.0f, O = 0.0f;
        if (M != T_NEG_INF) {
#pragma unroll
            for (int w = 0; w < DEC_WARPS; w++) {
                const float mw = cm[(w * 16 + g) * 2];
                if (mw == T_NEG_INF) continue;
                const float wt = exp2f(mw - M);
                L += cm[(w * 16 + g) * 2 + 1] * wt;
                O += co[(w * 16 + g) * HD + d] * wt;
            }
        }
        if (P.num_splits == 1) {
            out[(size_t)q0 * P.num_heads * HD + ((size_t)kvh * G + g) * HD + d] = f2bf(L > 0.0f ? O / L : 0.0f);
        } else {
            float* dst = part + g * (HD + 2);
            if (d == 0) {
                dst[0] = M == T_NEG_INF ? T_NEG_INF : M * 0.6931471805599453f;  // base 2 -> natural log
                dst[1] = L;
            }
            dst[2 + d] = O;
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
