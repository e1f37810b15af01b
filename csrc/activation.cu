// SiLU(gate) * up over the fused gate_up projection: x [rows, 2 * inter] (gate half first) -> out [rows, inter].
// One launch instead of torch's two (silu, then mul), 16-byte vectors. Rounding follows the torch reference:
// silu is computed in float32 (accurate expf, as ATen) and rounded to T, then the product is rounded to T.
#include <algorithm>

#include "fp8.cuh"

namespace rollout_kernels {
namespace {

// silu(gate) * up for vector i of a row, rounded as the reference rounds.
template <typename T>
__device__ __forceinline__ void silu_mul_vec(const T* gate, const T* up, int i, float (&out)[kVec]) {
  Vec16<T> g, u;
  g.raw = *reinterpret_cast<const uint4*>(gate + i);
  u.raw = *reinterpret_cast<const uint4*>(up + i);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float a = to_float(g.e[j]);
    const float silu = round_to<T>(a / (1.f + expf(-a)));
    out[j] = round_to<T>(silu * to_float(u.e[j]));
  }
}

template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, int inter, int64_t out_stride,
                                    int64_t x_stride) {
  dependent_prologue();
  const int64_t row = blockIdx.x;
  const T* gate = x + row * x_stride;
  const T* up = gate + inter;
  T* y = out + row * out_stride;
  for (int i = (blockIdx.y * blockDim.x + threadIdx.x) * kVec; i < inter; i += gridDim.y * blockDim.x * kVec) {
    float f[kVec];
    silu_mul_vec(gate, up, i, f);
    Vec16<T> o;
#pragma unroll
    for (int j = 0; j < kVec; ++j) o.e[j] = from_float<T>(f[j]);
    *reinterpret_cast<uint4*>(y + i) = o.raw;
  }
}

// The product quantized to e4m3 per row (fp8.cuh) for the FP8 down projection: one CTA per row, since the
// row's amax must be known before any byte is written; pass 2 recomputes the products (L1/L2 reads).
template <typename T>
__global__ void silu_and_mul_fp8_kernel(uint8_t* __restrict__ q, float* __restrict__ q_scale,
                                        const T* __restrict__ x, int inter, int64_t x_stride) {
  __shared__ float scratch[32];
  dependent_prologue();
  const int64_t row = blockIdx.x;
  const T* gate = x + row * x_stride;
  const T* up = gate + inter;
  float amax = 0.f;
  for (int i = threadIdx.x * kVec; i < inter; i += blockDim.x * kVec) {
    float f[kVec];
    silu_mul_vec(gate, up, i, f);
#pragma unroll
    for (int j = 0; j < kVec; ++j) amax = nan_max(amax, fabsf(f[j]));
  }
  const float s = e4m3_scale(block_amax(amax, scratch));
  if (threadIdx.x == 0) q_scale[row] = s;
  uint8_t* qr = q + row * inter;
  for (int i = threadIdx.x * kVec; i < inter; i += blockDim.x * kVec) {
    float f[kVec];
    silu_mul_vec(gate, up, i, f);
    *reinterpret_cast<uint2*>(qr + i) = to_e4m3x8(f, s);
  }
}

}  // namespace

cudaError_t silu_and_mul(void* out, const void* x, DType dtype, int64_t rows, int64_t inter, int64_t out_stride,
                         int64_t x_stride, cudaStream_t stream) {
  if (inter % kVec != 0 || inter <= 0 || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  constexpr int threads = 256;
  // One vector per thread: a row spread over several CTAs keeps enough loads in flight at any batch (one
  // CTA per row left a 256-row decode batch at a third of the bandwidth).
  const int64_t chunks = std::min<int64_t>((inter / kVec + threads - 1) / threads, 65535);
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(chunks));
  return ROLLOUT_DISPATCH_HALF(dtype, T, [&] {
    return launch_dependent(silu_and_mul_kernel<T>, grid, dim3(threads), 0, stream, static_cast<T*>(out),
                            static_cast<const T*>(x), static_cast<int>(inter), out_stride, x_stride);
  });
}

cudaError_t silu_and_mul_fp8(void* q, float* q_scale, const void* x, DType dtype, int64_t rows, int64_t inter,
                             int64_t x_stride, cudaStream_t stream) {
  if (inter % kVec != 0 || inter <= 0 || inter > 0x3fffffff || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return ROLLOUT_DISPATCH_HALF(dtype, T, [&] {
    return launch_dependent(silu_and_mul_fp8_kernel<T>, dim3(unsigned(rows)), dim3(fp8_row_threads(inter)), 0,
                            stream, static_cast<uint8_t*>(q), q_scale, static_cast<const T*>(x),
                            static_cast<int>(inter), x_stride);
  });
}

}  // namespace rollout_kernels
