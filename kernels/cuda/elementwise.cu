// Row-wise and element-wise kernels: embedding gather, RMSNorm (with the fused residual add),
// RoPE, SiLU·mul and the paged KV write. Every one is memory bound: the vector paths move 16 bytes
// per load; a `vec` flag (decided by the launcher from the shapes and pointer alignment) picks them,
// and the scalar paths compute exactly the same values.

// out[t, :] = f32(table[ids[t], :]); an id >= vocab gives a row of zeros.
// Grid: (T, ceil(h / (8 * blockDim.x))). vec: h % 8 == 0 and both pointers 16-byte aligned.
extern "C" __global__ void embedding(const bf16* __restrict__ table, const u32* __restrict__ ids,
                                     float* __restrict__ out, int vocab, int h, int vec) {
    const int t = blockIdx.x;
    const u32 id = ids[t];
    const bool ok = id < (u32)vocab;
    float* o = out + (size_t)t * h;
    const bf16* row = table + (size_t)(ok ? id : 0) * h;
    if (vec) {
        const int i = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
        if (i >= h) return;
        float f[8];
        if (ok) {
            unpack8(*reinterpret_cast<const uint4*>(row + i), f);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) f[j] = 0.0f;
        }
        reinterpret_cast<float4*>(o + i)[0] = make_float4(f[0], f[1], f[2], f[3]);
        reinterpret_cast<float4*>(o + i)[1] = make_float4(f[4], f[5], f[6], f[7]);
    } else {
        const int base = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
        for (int i = base; i < base + 8 && i < h; i++) o[i] = ok ? bf2f(row[i]) : 0.0f;
    }
}

// One block per row. If `delta` is non-null, x += delta first (written back to x). Then
// out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight), all arithmetic in f32: HF's
// `weight * hidden.to(bfloat16)`. Each thread handles the same columns in both passes, so it
// reads back only its own writes. vec: h % 4 == 0 and x, delta 16-byte, weight, out 8-byte aligned.
extern "C" __global__ void rms_norm(float* __restrict__ x, const float* __restrict__ delta,
                                    const bf16* __restrict__ weight, bf16* __restrict__ out, int h,
                                    float eps, int vec) {
    __shared__ float scratch[32];
    const size_t r = blockIdx.x;
    float* xr = x + r * h;
    const float* dr = delta ? delta + r * h : nullptr;
    bf16* orow = out + r * h;
    float ss = 0.0f;
    if (vec) {
        for (int i = threadIdx.x * 4; i < h; i += blockDim.x * 4) {
            float4 v = *reinterpret_cast<const float4*>(xr + i);
            if (dr) {
                const float4 d = *reinterpret_cast<const float4*>(dr + i);
                v.x += d.x; v.y += d.y; v.z += d.z; v.w += d.w;
                *reinterpret_cast<float4*>(xr + i) = v;
            }
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    } else {
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            float v = xr[i];
            if (dr) {
                v += dr[i];
                xr[i] = v;
            }
            ss += v * v;
        }
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)h + eps);
    if (vec) {
        for (int i = threadIdx.x * 4; i < h; i += blockDim.x * 4) {
            const float4 v = *reinterpret_cast<const float4*>(xr + i);
            const uint2 w = *reinterpret_cast<const uint2*>(weight + i);
            uint2 o;
            o.x = pack_bf16x2(bf2f(f2bf(v.x * inv)) * bf_lo(w.x), bf2f(f2bf(v.y * inv)) * bf_hi(w.x));
            o.y = pack_bf16x2(bf2f(f2bf(v.z * inv)) * bf_lo(w.y), bf2f(f2bf(v.w * inv)) * bf_hi(w.y));
            *reinterpret_cast<uint2*>(orow + i) = o;
        }
    } else {
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            orow[i] = f2bf(bf2f(f2bf(xr[i] * inv)) * bf2f(weight[i]));
        }
    }
}

// Rotate-half RoPE in place on the first `heads * head_dim` columns of each row of qkv
// ([T, row_stride] bf16): for i < head_dim/2, (x_i, x_{i+hd/2}) rotate by pos * inv_freq[i].
// One block per token; cos/sin are computed once per token into shared memory with the accurate
// sincosf, the rotation in f32, rounded once to bf16.
extern "C" __global__ void rope(bf16* __restrict__ qkv, const int* __restrict__ positions,
                                const float* __restrict__ inv_freq, int heads, int head_dim,
                                int row_stride) {
    extern __shared__ float cs[];  // [half] cos, then [half] sin
    const int t = blockIdx.x;
    const int half = head_dim / 2;
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        cs[i] = c;
        cs[half + i] = s;
    }
    __syncthreads();
    bf16* row = qkv + (size_t)t * row_stride;
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        const int hh = idx / half, i = idx % half;
        bf16* a = row + hh * head_dim + i;
        const float x1 = bf2f(a[0]), x2 = bf2f(a[half]);
        const float c = cs[i], s = cs[half + i];
        a[0] = f2bf(x1 * c - x2 * s);
        a[half] = f2bf(x2 * c + x1 * s);
    }
}

// out[t, i] = bf16(silu(gate) * up) with gate = gate_up[t, i], up = gate_up[t, inter + i], in f32.
// Grid: (T, ceil(inter / (8 * blockDim.x))). vec: inter % 8 == 0 and both pointers 16-byte aligned.
extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out,
                                    int inter, int vec) {
    const size_t t = blockIdx.x;
    const bf16* g = gate_up + t * 2 * inter;
    const bf16* u = g + inter;
    bf16* o = out + t * inter;
    const int base = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (base >= inter) return;
    if (vec) {
        float gf[8], uf[8], of[8];
        unpack8(*reinterpret_cast<const uint4*>(g + base), gf);
        unpack8(*reinterpret_cast<const uint4*>(u + base), uf);
#pragma unroll
        for (int j = 0; j < 8; j++) of[j] = gf[j] / (1.0f + expf(-gf[j])) * uf[j];
        *reinterpret_cast<uint4*>(o + base) = pack8(of);
    } else {
        for (int i = base; i < base + 8 && i < inter; i++) {
            const float gv = bf2f(g[i]);
            o[i] = f2bf(gv / (1.0f + expf(-gv)) * bf2f(u[i]));
        }
    }
}

// Copies token t's K and V heads (qkv row t, columns k_col.. and k_col + kv_heads*head_dim..) into
// the paged cache ([num_blocks][2][kv_heads][block_size][head_dim] bf16) at slot slots[t] =
// block * block_size + offset. A negative slot (padding) or a block >= num_blocks is skipped.
// One block per token; one 16-byte copy per thread step (the launcher checks 16-byte alignment of
// every row start).
extern "C" __global__ void write_kv(const bf16* __restrict__ qkv, const int* __restrict__ slots,
                                    bf16* __restrict__ cache, int num_blocks, int block_size,
                                    int kv_heads, int head_dim, int k_col, int row_stride) {
    const int t = blockIdx.x;
    const int slot = slots[t];
    if (slot < 0) return;
    const int block = slot / block_size, off = slot % block_size;
    if (block >= num_blocks) return;
    const int vecs_per_head = head_dim / 8;
    const int per_kind = kv_heads * vecs_per_head;
    const bf16* src_row = qkv + (size_t)t * row_stride + k_col;
    const size_t block_elems = (size_t)2 * kv_heads * block_size * head_dim;
    bf16* dst_block = cache + (size_t)block * block_elems;
    for (int idx = threadIdx.x; idx < 2 * per_kind; idx += blockDim.x) {
        const int kind = idx / per_kind;  // 0 = K, 1 = V
        const int rem = idx % per_kind;
        const int head = rem / vecs_per_head, v = rem % vecs_per_head;
        const uint4 val = *reinterpret_cast<const uint4*>(src_row + kind * kv_heads * head_dim +
                                                          head * head_dim + v * 8);
        bf16* dst = dst_block + (size_t)kind * kv_heads * block_size * head_dim +
                    ((size_t)head * block_size + off) * head_dim + v * 8;
        *reinterpret_cast<uint4*>(dst) = val;
    }
}

// Token ids that come from an earlier step's sampler (overlapped scheduling): for i < n with
// src[i] >= 0, ids[i] = sampled[src[i]]; an index outside the `num_sampled` draws leaves ids[i]
// unchanged. One thread per token.
extern "C" __global__ void resolve_tokens(u32* __restrict__ ids, const int* __restrict__ src,
                                          const u32* __restrict__ sampled, int n, int num_sampled) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int s = src[i];
    if (s >= 0 && s < num_sampled) ids[i] = sampled[s];
}
