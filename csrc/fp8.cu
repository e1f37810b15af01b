// Per-row e4m3 quantization of activations (fp8.cuh), for an FP8 product's input that no earlier kernel
// quantized (the attention output before o_proj). One CTA per row: pass 1 finds the row's amax, pass 2
// re-reads the row (from L1/L2: the CTA just read it) and writes e4m3 bytes; nothing is held in shared memory,
// so any row length works.
#include "fp8.cuh"

namespace rollout_kernels {
namespace {

template <typename T>
__global__ void fp8_quantize_kernel(uint8_t* __restrict__ q, float* __restrict__ scale, const T* __restrict__ x,
                                    int cols, int64_t x_stride) {
  __shared__ float scratch[32];
  dependent_prologue();
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const int nvec = cols / kVec;
  float amax = 0.f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec16<T> v;
    v.raw = *reinterpret_cast<const uint4*>(xr + i * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) amax = nan_max(amax, fabsf(to_float(v.e[j])));
  }
  const float s = e4m3_scale(block_amax(amax, scratch));
  if (threadIdx.x == 0) scale[row] = s;
  uint8_t* qr = q + row * cols;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec16<T> v;
    v.raw = *reinterpret_cast<const uint4*>(xr + i * kVec);
    float f[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) f[j] = to_float(v.e[j]);
    *reinterpret_cast<uint2*>(qr + i * kVec) = to_e4m3x8(f, s);
  }
}

}  // namespace

int fp8_row_threads(int64_t cols) {
  const int nvec = static_cast<int>(cols / kVec);
  const int threads = ((nvec + 31) / 32) * 32;
  return threads < 32 ? 32 : (threads > 1024 ? 1024 : threads);
}

cudaError_t fp8_quantize(void* q, float* scale, const void* x, DType dtype, int64_t rows, int64_t cols,
                         int64_t x_stride, cudaStream_t stream) {
  if (cols <= 0 || cols % kVec != 0 || cols > 0x7fffffff || rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return ROLLOUT_DISPATCH_HALF(dtype, T, [&] {
    return launch_dependent(fp8_quantize_kernel<T>, dim3(unsigned(rows)), dim3(fp8_row_threads(cols)), 0, stream,
                            static_cast<uint8_t*>(q), scale, static_cast<const T*>(x), static_cast<int>(cols),
                            x_stride);
  });
}

}  // namespace rollout_kernels
