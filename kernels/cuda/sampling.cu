// Token sampling on the GPU: one CTA of SMP_THREADS threads per row of logits.
//
// Pipeline (the engine's CPU sampler, engine/src/sampling): sanitise (NaN -> -inf, +inf -> FLT_MAX,
// -0 -> +0) -> penalties (written back to the row, so the host can read top logprobs from it) ->
// greedy argmax, or: work = (l - max) / T, weights w = exp(work) -> top-k -> top-p -> min-p -> draw.
//
// Nothing sorts the vocabulary. Candidates are ranked by a 64-bit key (order-preserving bits of
// `work`, then the complement of the id, so ties go to the lower id); every filter and the draw is
// "find the first candidate, best first, whose cumulative count/mass reaches a target", answered by
// a radix select over the key, 8 bits per pass: a pass histograms (count, f64 mass) of the
// candidates matching the prefix chosen so far, warp 0 scans the 256 buckets best-first and picks
// the one where the cumulative quantity crosses the target, and the next pass refines inside it.
// A pass ends early once the chosen bucket holds one candidate. The survivors of each filter are
// always a best-first prefix (top-k/top-p by construction; min-p because w is monotone in the key),
// so the state between filters is one key threshold plus min-p's weight threshold.
// Histogram updates are run-length merged per thread before the shared atomics, which keeps the
// first passes (where most keys share their top byte) from serialising on one bucket.

#define SMP_THREADS 1024

// Must match `SampleParams` in kernels/src/cuda/sampling.rs.
struct SampleParams {
    float temperature;  // 0 = greedy
    int top_k;          // 0 = off
    float top_p;        // 1 = off
    float min_p;        // 0 = off
    float repetition;   // 1 = off
    float presence;
    float frequency;
    float uniform;      // the draw, in [0, 1)
};

// The CPU sampler's exp (engine/src/sampling/math.rs exp_f32), operation for operation and without
// FMA contraction, so weights match it bit for bit: relative error < 2e-7, exactly 0 below -87.3.
__device__ __forceinline__ float exp_cpu(float x) {
    const float LOG2E = 1.44269502f, LN2_HI = 0.693145752f, LN2_LO = 1.42860677e-6f;
    const float MAGIC = 12582912.0f, LO = -87.3f, HI = 88.0f;
    const float xc = fminf(fmaxf(x, LO), HI);
    const float k = __fadd_rn(__fmul_rn(xc, LOG2E), MAGIC);
    const float n = __fsub_rn(k, MAGIC);
    const float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = 1.0f / 5040.0f;
    p = __fadd_rn(1.0f / 720.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f / 120.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f / 24.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f / 6.0f, __fmul_rn(r, p));
    p = __fadd_rn(0.5f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    const u32 e = (__float_as_uint(k) - __float_as_uint(MAGIC) + 127u) << 23;
    const float y = __fmul_rn(p, __uint_as_float(e));
    return x < LO ? 0.0f : y;
}

__device__ __forceinline__ u64 rank_key(float work, int id) {
    const u32 b = __float_as_uint(work);
    const u32 ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)ordered << 32) | (u64)(0xffffffffu - (u32)id);
}

// How a row's logits become `work`: (l - max) * (1/T), or / T when 1/T overflows; unchanged when
// the max is not finite (every logit -inf).
struct WorkMap {
    float max, inv, temperature;
    int mode;  // 0: (l - max) * inv, 1: (l - max) / T, 2: l
    __device__ __forceinline__ float operator()(float l) const {
        if (mode == 0) return __fmul_rn(__fsub_rn(l, max), inv);
        if (mode == 1) return __fdiv_rn(__fsub_rn(l, max), temperature);
        return l;
    }
};

struct SelectShared {
    u32 count[256];
    double mass[256];
    u64 prefix;
    double above;
    double target;
    int shift;
    int digit;
    u32 digit_count;
    int status;  // 0 = continue, 1 = done (prefix is the key), 2 = need the find pass, 3 = none
    u64 key;
};

// Finds the first candidate, best first, whose cumulative quantity (1 per candidate, or its
// weight) reaches `target` (`strict`: exceeds it). Candidates: work > -inf, key >= lo_key, w >=
// wthr. With `frac`, the target is `target * (total quantity of the candidates)`. If no candidate
// crosses, `fallback_last` picks the last candidate with positive quantity; otherwise returns
// false.
__device__ bool radix_select(const float* __restrict__ row, int vocab, const WorkMap& wm, u64 lo_key, float wthr,
                             bool by_mass, double target, bool frac, bool strict, bool fallback_last, u64* key_out,
                             SelectShared& S) {
    const int tid = threadIdx.x, lane = tid & 31;
    __syncthreads();  // every thread is done with S from the previous call
    if (tid == 0) {
        S.prefix = 0;
        S.above = 0.0;
        S.shift = 64;
    }
    for (int pass = 0;; pass++) {
        for (int i = tid; i < 256; i += SMP_THREADS) {
            S.count[i] = 0;
            S.mass[i] = 0.0;
        }
        __syncthreads();
        const u64 prefix = S.prefix;
        const int shift = S.shift;
        int cur = -1;
        u32 cnt = 0;
        double m = 0.0;
        for (int i = tid; i < vocab; i += SMP_THREADS) {
            const float work = wm(row[i]);
            if (!(work > T_NEG_INF)) continue;
            const u64 key = rank_key(work, i);
            if (key < lo_key) continue;
            const float w = exp_cpu(work);
            if (w < wthr) continue;
            if (shift < 64 && (key >> shift) != (prefix >> shift)) continue;
            const int d = (int)((key >> (shift - 8)) & 255);
            if (d != cur) {
                if (cnt) {
                    atomicAdd(&S.count[cur], cnt);
                    atomicAdd(&S.mass[cur], m);
                }
                cur = d;
                cnt = 0;
                m = 0.0;
            }
            cnt++;
            m += (double)w;
        }
        if (cnt) {
            atomicAdd(&S.count[cur], cnt);
            atomicAdd(&S.mass[cur], m);
        }
        __syncthreads();
        if (tid < 32) {
            // Lane L scans digits 255 - 8L down to 248 - 8L (best first).
            double q[8];
            u32 c8[8];
            double lane_sum = 0.0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int d = 255 - (lane * 8 + j);
                c8[j] = S.count[d];
                q[j] = by_mass ? S.mass[d] : (double)c8[j];
                lane_sum += q[j];
            }
            double incl = lane_sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const double v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            const double total_here = __shfl_sync(0xffffffffu, incl, 31);
            if (pass == 0) {
                if (lane == 0) S.target = frac ? target * total_here : target;
                __syncwarp();
            }
            const double tgt = S.target;
            double run = S.above + (incl - lane_sum);
            int cross = -1;
            double cross_above = 0.0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const bool hit = q[j] > 0.0 && (strict ? run + q[j] > tgt : run + q[j] >= tgt);
                if (hit && cross < 0) {
                    cross = j;
                    cross_above = run;
                }
                run += q[j];
            }
            const u32 ballot = __ballot_sync(0xffffffffu, cross >= 0);
            int chosen_lane = -1, chosen_j = 0;
            if (ballot) {
                chosen_lane = __ffs(ballot) - 1;
                chosen_j = __shfl_sync(0xffffffffu, cross, chosen_lane);
                cross_above = __shfl_sync(0xffffffffu, cross_above, chosen_lane);
            } else if (pass > 0 || fallback_last) {
                // Nothing crosses (rounding): the last bucket with positive quantity, else the
                // last non-empty one.
                int last = -1;
                double last_above = 0.0;
                double r2 = S.above + (incl - lane_sum);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (q[j] > 0.0 || (c8[j] > 0 && !by_mass)) {
                        last = j;
                        last_above = r2;
                    }
                    r2 += q[j];
                }
                u32 b2 = __ballot_sync(0xffffffffu, last >= 0);
                if (!b2) {
                    // No positive mass anywhere: any non-empty bucket.
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        if (c8[j] > 0) last = j;
                    b2 = __ballot_sync(0xffffffffu, last >= 0);
                }
                if (b2) {
                    chosen_lane = 31 - __clz(b2);
                    chosen_j = __shfl_sync(0xffffffffu, last, chosen_lane);
                    cross_above = __shfl_sync(0xffffffffu, last_above, chosen_lane);
                }
            }
            if (lane == 0) {
                if (chosen_lane < 0) {
                    S.status = 3;
                } else {
                    const int d = 255 - (chosen_lane * 8 + chosen_j);
                    S.digit = d;
                    S.digit_count = S.count[d];
                    S.above = cross_above;
                    S.prefix = prefix | ((u64)d << (shift - 8));
                    S.shift = shift - 8;
                    S.status = (shift - 8 == 0) ? 1 : (S.count[d] == 1 ? 2 : 0);
                }
            }
        }
        __syncthreads();
        const int status = S.status;
        if (status == 3) return false;
        if (status == 1) {
            *key_out = S.prefix;
            return true;
        }
        if (status == 2) {
            // One candidate left under the prefix: find it.
            const u64 pre = S.prefix;
            const int sh = S.shift;
            for (int i = tid; i < vocab; i += SMP_THREADS) {
                const float work = wm(row[i]);
                if (!(work > T_NEG_INF)) continue;
                const u64 key = rank_key(work, i);
                if (key < lo_key || exp_cpu(work) < wthr) continue;
                if ((key >> sh) == (pre >> sh)) S.key = key;
            }
            __syncthreads();
            *key_out = S.key;
            return true;
        }
        __syncthreads();  // everyone has read S before the next pass clears it
    }
}

extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    sample(float* __restrict__ logits, int vocab, const SampleParams* __restrict__ params,
           const int* __restrict__ pen_offsets, const int* __restrict__ pen_tokens,
           const int* __restrict__ pen_counts, int pen_len, u32* __restrict__ out_tokens,
           float* __restrict__ out_logprobs) {
    __shared__ SelectShared S;
    __shared__ float red_v[32];
    __shared__ int red_i[32];
    __shared__ double red_d[32];
    const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float* row = logits + (size_t)r * vocab;
    const SampleParams sp = params[r];

    // 1. Sanitise.
    for (int i = tid; i < vocab; i += SMP_THREADS) {
        const float v = row[i];
        row[i] = isnan(v) ? T_NEG_INF : fminf(v, T_FLT_MAX) + 0.0f;
    }
    __syncthreads();
    // 2. Penalties over the row's distinct tokens (the host lists each token once).
    {
        const int lo = min(max(pen_offsets[r], 0), pen_len);
        const int hi = min(max(pen_offsets[r + 1], lo), pen_len);
        for (int j = lo + tid; j < hi; j += SMP_THREADS) {
            const int t = pen_tokens[j];
            if (t < 0 || t >= vocab) continue;
            float v = row[t];
            if (sp.repetition != 1.0f) v = v > 0.0f ? __fdiv_rn(v, sp.repetition) : __fmul_rn(v, sp.repetition);
            const int cnt = pen_counts[j];
            if (cnt > 0 && (sp.presence != 0.0f || sp.frequency != 0.0f))
                v = __fsub_rn(v, __fadd_rn(sp.presence, __fmul_rn(sp.frequency, (float)cnt)));
            row[t] = v;
        }
    }
    __syncthreads();
    // 3. Max and argmax (lowest index on ties).
    float best = T_NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = tid; i < vocab; i += SMP_THREADS) {
        const float v = row[i];
        if (v > best || (v == best && i < best_i)) {
            best = v;
            best_i = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) {
            best = ov;
            best_i = oi;
        }
    }
    if (lane == 0) {
        red_v[warp] = best;
        red_i[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
        best = red_v[lane];
        best_i = red_i[lane];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ov > best || (ov == best && oi < best_i)) {
                best = ov;
                best_i = oi;
            }
        }
        if (lane == 0) {
            red_v[0] = best;
            red_i[0] = best_i;
        }
    }
    __syncthreads();
    const float max_l = red_v[0];
    const int argmax = red_i[0] < vocab ? red_i[0] : 0;
    __syncthreads();

    WorkMap wm;
    wm.max = max_l;
    wm.temperature = sp.temperature;
    const bool greedy = sp.temperature == 0.0f;
    if (greedy || !(max_l > T_NEG_INF)) {
        wm.mode = greedy && max_l > T_NEG_INF ? 0 : 2;
        wm.inv = 1.0f;  // greedy: logprobs over the penalised logits, temperature 1
    } else {
        wm.inv = 1.0f / sp.temperature;
        wm.mode = isinf(wm.inv) ? 1 : 0;
    }
    // Σ exp(work), in f64; for greedy work = l - max and the lse adds max back.
    double part = 0.0;
    for (int i = tid; i < vocab; i += SMP_THREADS) part += (double)exp_cpu(wm(row[i]));
    const double total = block_sum_f64(part, red_d);
    float lse;
    if (!(max_l > T_NEG_INF)) lse = T_NEG_INF;
    else if (greedy) lse = (float)((double)max_l + log(total));
    else lse = total > 0.0 ? (float)log(total) : T_NEG_INF;

    int token = argmax;
    if (!greedy && max_l > T_NEG_INF) {
        const bool k_active = sp.top_k > 0 && sp.top_k < vocab;
        u64 lo_key = 0;
        u64 key;
        if (k_active && radix_select(row, vocab, wm, 0, 0.0f, false, (double)sp.top_k, false, false, false, &key, S))
            lo_key = key;
        if (sp.top_p < 1.0f &&
            radix_select(row, vocab, wm, lo_key, 0.0f, true, (double)sp.top_p, true, false, false, &key, S))
            lo_key = key;
        // min-p: the best candidate's weight is exp(0) = 1, so the threshold is min_p itself.
        const float wthr = sp.min_p > 0.0f ? sp.min_p * 1.0f : 0.0f;
        if (radix_select(row, vocab, wm, lo_key, wthr, true, (double)sp.uniform, true, true, true, &key, S))
            token = (int)(0xffffffffu - (u32)(key & 0xffffffffu));
    }
    if (tid == 0) {
        out_tokens[r] = (u32)token;
        // Greedy: l - (max + ln Σ), as the CPU's log-softmax; otherwise work - ln Σ.
        const float x = greedy ? row[token] : wm(row[token]);
        out_logprobs[r] = lse > T_NEG_INF && lse < T_INF ? x - lse : T_NEG_INF;
    }
}
