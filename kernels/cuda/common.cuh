// Shared helpers for every tandem kernel. The runtime concatenates common.cuh and the .cu files into
// one NVRTC translation unit (see kernels/src/cuda/compile.rs), so nothing here may #include a CUDA
// toolkit header: NVRTC as shipped has none of them (not even cuda_bf16.h). bf16 is therefore a
// plain 16-bit pattern with conversions written with bit operations and sm_80+ PTX.
//
// Conventions for every kernel:
// - all kernels are `extern "C"` so the runtime finds them by their plain names;
// - sizes arrive as int (the launchers check they fit); pointers to bf16 are `const bf16*`;
// - a kernel never dereferences memory outside the buffers its launcher checked: indices read from
//   device memory (token ids, block ids, slots, offsets) are validated in the kernel.

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define T_INF __int_as_float(0x7f800000)
#define T_NEG_INF __int_as_float(0xff800000)
#define T_FLT_MAX 3.402823466e+38f

// bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((u32)h) << 16); }

// f32 -> bf16, round to nearest even (NaN stays NaN), as PyTorch's `.to(bfloat16)`.
__device__ __forceinline__ bf16 f2bf(float f) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two f32 -> packed bf16x2: `lo` in the low half (the lower address), `hi` in the high half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

// Eight bf16 (one 16-byte load) to f32.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    f[0] = bf_lo(v.x); f[1] = bf_hi(v.x);
    f[2] = bf_lo(v.y); f[3] = bf_hi(v.y);
    f[4] = bf_lo(v.z); f[5] = bf_hi(v.z);
    f[6] = bf_lo(v.w); f[7] = bf_hi(v.w);
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 v;
    v.x = pack_bf16x2(f[0], f[1]);
    v.y = pack_bf16x2(f[2], f[3]);
    v.z = pack_bf16x2(f[4], f[5]);
    v.w = pack_bf16x2(f[6], f[7]);
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Block-wide sum; every thread gets the result. `scratch` holds >= 32 floats; blockDim.x is a
// multiple of 32. Ends with a barrier so `scratch` can be reused at once.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum_f64(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < warps ? scratch[lane] : 0.0;
    t = warp_sum_f64(t);
    __syncthreads();
    return t;
}

// 16-byte global -> shared copy that bypasses registers (sm_80+ cp.async). `src` and `dst` are
// 16-byte aligned. With `valid == false` the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    u32 d = (u32)__cvta_generic_to_shared(dst);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
