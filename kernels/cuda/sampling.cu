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
// Once the chosen bucket holds at most 1024 candidates they are gathered into shared memory,
// sorted (bitonic) and scanned there, so a select takes a few passes over the row, not eight.
// The survivors of each filter are always a best-first prefix (top-k/top-p by construction; min-p
// because w is monotone in the key), so the state between filters is one key threshold plus
// min-p's weight threshold.
// Each warp histograms into its own copy (dynamic shared memory), so the first passes, where most
// keys share their top byte, do not serialise the whole CTA on one bucket; masses are fixed-point
// integers, so the sums are exact, order-independent and use native atomics.

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

#define SMALL_BUCKET SMP_THREADS  // a bucket this small is finished by sorting it in shared memory

struct SelectShared {
    u32 count[256];
    double mass[256];
    u64 keys[SMALL_BUCKET];   // the small bucket's candidates, sorted best first
    float ws[SMALL_BUCKET];   // and their weights
    double wsum[32];          // per-warp totals of the scan
    u64 prefix;
    double above;             // quantity of the candidates better than the current bucket
    double target;
    int shift;                // bits of the key below the chosen prefix
    int status;               // 0 = next pass, 1 = prefix is the key, 2 = find the one candidate, 3 = none, 4 = sort the bucket
    int n;                    // candidates gathered
    int first, last;
    u64 key;
};

// The warps' private histograms in dynamic shared memory: [32 warps][256] counts, then
// [32 warps][256] masses (fixed point: weight * 2^mass_bits). 96 KiB.
struct WarpHist {
    u32* count;
    u64* mass;
};

// Bits of fraction for masses: weights are <= 1 (the best has work 0, weight 1), so a row's total
// stays below 2^62 with `62 - ceil(log2(vocab))` bits (44 for 256k entries; capped at 52).
// Rounding costs < 2^-mass_bits per weight: a relative error < 1e-8 of a row's total, and a weight
// below 2^-mass_bits counts as 0 for the mass (it could be drawn with probability < 1e-13).
__device__ __forceinline__ int mass_bits_for(int vocab) {
    int lg = 0;
    while ((1 << lg) < vocab && lg < 31) lg++;
    return min(52, 62 - lg);
}

__device__ __forceinline__ u64 fixed_mass(float w, int bits) {
    return (u64)__double2ull_rn((double)w * (double)(1ULL << bits));
}

// The candidate at `i` (vocab order) as (key, weight), or false if it is not one.
__device__ __forceinline__ bool candidate(const float* __restrict__ row, int i, const WorkMap& wm, u64 lo_key,
                                          float wthr, u64* key, float* w) {
    const float work = wm(row[i]);
    if (!(work > T_NEG_INF)) return false;
    *key = rank_key(work, i);
    if (*key < lo_key) return false;
    *w = exp_cpu(work);
    return *w >= wthr;
}

// Finds the first candidate, best first, whose cumulative quantity (1 per candidate, or its
// weight) reaches `target` (`strict`: exceeds it). Candidates: work > -inf, key >= lo_key, w >=
// wthr. With `frac`, the target is `target * (total quantity of the candidates)`. If no candidate
// crosses, `fallback_last` picks the last candidate with positive quantity; otherwise returns
// false. Radix passes narrow the key prefix 8 bits at a time until the bucket holds at most
// SMALL_BUCKET candidates, which are then gathered, sorted and scanned in shared memory.
__device__ bool radix_select(const float* __restrict__ row, int vocab, const WorkMap& wm, u64 lo_key, float wthr,
                             bool by_mass, double target, bool frac, bool strict, bool fallback_last, u64* key_out,
                             SelectShared& S, WarpHist H, int mass_bits) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    __syncthreads();  // every thread is done with S from the previous call
    if (tid == 0) {
        S.prefix = 0;
        S.above = 0.0;
        S.shift = 64;
    }
    for (int pass = 0;; pass++) {
        for (int i = tid; i < 32 * 256; i += SMP_THREADS) {
            H.count[i] = 0;
            H.mass[i] = 0;
        }
        __syncthreads();
        const u64 prefix = S.prefix;
        const int shift = S.shift;
        // Histogram of the next 8 bits into this warp's private copy: conflicting atomics stay
        // within a warp, and integer (fixed-point) mass makes every sum exact and deterministic.
        u32* my_count = H.count + warp * 256;
        u64* my_mass = H.mass + warp * 256;
        for (int i = tid; i < vocab; i += SMP_THREADS) {
            u64 key;
            float w;
            if (candidate(row, i, wm, lo_key, wthr, &key, &w) && (shift == 64 || (key >> shift) == (prefix >> shift))) {
                const int d = (int)((key >> (shift - 8)) & 255);
                atomicAdd(&my_count[d], 1u);
                atomicAdd(&my_mass[d], fixed_mass(w, mass_bits));
            }
        }
        __syncthreads();
        for (int d = tid; d < 256; d += SMP_THREADS) {
            u32 c = 0;
            u64 m = 0;
            for (int wp = 0; wp < SMP_THREADS / 32; wp++) {
                c += H.count[wp * 256 + d];
                m += H.mass[wp * 256 + d];
            }
            S.count[d] = c;
            S.mass[d] = (double)m;
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
            if (pass == 0) {
                const double total_here = __shfl_sync(0xffffffffu, incl, 31);
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
                    if (q[j] > 0.0) {
                        last = j;
                        last_above = r2;
                    }
                    r2 += q[j];
                }
                u32 b2 = __ballot_sync(0xffffffffu, last >= 0);
                if (!b2) {
                    r2 = S.above + (incl - lane_sum);
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        if (c8[j] > 0) {
                            last = j;
                            last_above = r2;
                        }
                        r2 += q[j];
                    }
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
                    const u32 cnt = S.count[d];
                    S.above = cross_above;
                    S.prefix = prefix | ((u64)d << (shift - 8));
                    S.shift = shift - 8;
                    S.status = shift - 8 == 0 ? 1 : cnt == 1 ? 2 : cnt <= SMALL_BUCKET ? 4 : 0;
                    S.n = 0;
                    S.first = 0x7fffffff;
                    S.last = -1;
                }
            }
        }
        __syncthreads();
        const int status = S.status;
        if (status == 3) return false;
        if (status == 1) {
            const u64 k = S.prefix;
            __syncthreads();
            *key_out = k;
            return true;
        }
        if (status == 2 || status == 4) {
            // Gather the bucket's candidates.
            const u64 pre = S.prefix;
            const int sh = S.shift;
            for (int i = tid; i < vocab; i += SMP_THREADS) {
                u64 key;
                float w;
                if (candidate(row, i, wm, lo_key, wthr, &key, &w) && (key >> sh) == (pre >> sh)) {
                    const int slot = atomicAdd(&S.n, 1);
                    if (slot < SMALL_BUCKET) {
                        S.keys[slot] = key;
                        S.ws[slot] = w;
                    }
                }
            }
            __syncthreads();
            const int n = min(S.n, SMALL_BUCKET);
            if (status == 2 || n <= 1) {
                const u64 k = S.keys[0];
                __syncthreads();
                *key_out = k;
                return true;
            }
            // Bitonic sort, descending (padding keys 0 sink to the end).
            if (tid >= n) {
                S.keys[tid] = 0;
                S.ws[tid] = 0.0f;
            }
            __syncthreads();
            for (int k = 2; k <= SMALL_BUCKET; k <<= 1) {
                for (int j = k >> 1; j > 0; j >>= 1) {
                    const int ixj = tid ^ j;
                    if (ixj > tid) {
                        const u64 a = S.keys[tid], b = S.keys[ixj];
                        const bool desc = (tid & k) == 0;
                        if (desc ? a < b : a > b) {
                            S.keys[tid] = b;
                            S.keys[ixj] = a;
                            const float t = S.ws[tid];
                            S.ws[tid] = S.ws[ixj];
                            S.ws[ixj] = t;
                        }
                    }
                    __syncthreads();
                }
            }
            // Inclusive scan of the quantities, best first.
            const double qv = tid < n ? (by_mass ? (double)fixed_mass(S.ws[tid], mass_bits) : 1.0) : 0.0;
            double incl = qv;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const double v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            if (lane == 31) S.wsum[warp] = incl;
            __syncthreads();
            if (warp == 0) {
                double t = S.wsum[lane];
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const double v = __shfl_up_sync(0xffffffffu, t, o);
                    if (lane >= o) t += v;
                }
                S.wsum[lane] = t;
            }
            __syncthreads();
            const double cum = S.above + incl + (warp > 0 ? S.wsum[warp - 1] : 0.0);
            const double tgt = S.target;
            if (tid < n && qv > 0.0 && (strict ? cum > tgt : cum >= tgt)) atomicMin(&S.first, tid);
            if (tid < n && qv > 0.0) atomicMax(&S.last, tid);
            __syncthreads();
            const int pick = S.first != 0x7fffffff ? S.first : (S.last >= 0 ? S.last : n - 1);
            const u64 k = S.keys[pick];
            __syncthreads();
            *key_out = k;
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
    extern __shared__ __align__(16) unsigned char sample_smem[];
    WarpHist H;
    H.mass = reinterpret_cast<u64*>(sample_smem);
    H.count = reinterpret_cast<u32*>(sample_smem + 32 * 256 * sizeof(u64));
    const int mass_bits = mass_bits_for(vocab);
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
        if (k_active && radix_select(row, vocab, wm, 0, 0.0f, false, (double)sp.top_k, false, false, false, &key, S, H, mass_bits))
            lo_key = key;
        if (sp.top_p < 1.0f &&
            radix_select(row, vocab, wm, lo_key, 0.0f, true, (double)sp.top_p, true, false, false, &key, S, H, mass_bits))
            lo_key = key;
        // min-p: the best candidate's weight is exp(0) = 1, so the threshold is min_p itself.
        const float wthr = sp.min_p > 0.0f ? sp.min_p * 1.0f : 0.0f;
        if (radix_select(row, vocab, wm, lo_key, wthr, true, (double)sp.uniform, true, true, true, &key, S, H, mass_bits))
            token = (int)(0xffffffffu - (u32)(key & 0xffffffffu));
    }
    if (tid == 0) {
        out_tokens[r] = (u32)token;
        // Greedy: l - (max + ln Σ), as the CPU's log-softmax; otherwise work - ln Σ.
        const float x = greedy ? row[token] : wm(row[token]);
        out_logprobs[r] = lse > T_NEG_INF && lse < T_INF ? x - lse : T_NEG_INF;
    }
}
