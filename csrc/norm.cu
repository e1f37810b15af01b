// RMSNorm and fused residual-add + RMSNorm, one CTA per row, 16-byte vectors, float32 math.
// Rounding follows the torch reference (HF Llama): the residual sum is rounded to T, the normalised
// value is rounded to T before the weight multiply, whose product is rounded again.
#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  v = warp_sum(v);  // every warp reduces the partials, so no second broadcast is needed
  return v;
}

template <typename T, bool kAddResidual>
__global__ void rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, T* residual,
                                const T* __restrict__ weight, int hidden, int64_t out_stride, int64_t x_stride,
                                int64_t residual_stride, float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* rr = kAddResidual ? residual + row * residual_stride : nullptr;
  T* yr = out + row * out_stride;
  const int nvec = hidden / kVec;

  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec16<T> xv;
    xv.raw = *reinterpret_cast<const uint4*>(xr + i * kVec);
    if (kAddResidual) {
      Vec16<T> rv;
      rv.raw = *reinterpret_cast<const uint4*>(rr + i * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        rv.e[j] = from_float<T>(to_float(xv.e[j]) + to_float(rv.e[j]));
        const float f = to_float(rv.e[j]);
        sum_sq += f * f;
      }
      *reinterpret_cast<uint4*>(rr + i * kVec) = rv.raw;
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float f = to_float(xv.e[j]);
        sum_sq += f * f;
      }
    }
  }
  const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / hidden + eps);

  // Second pass: each thread re-reads the same vectors it handled above (its own writes for residual).
  const T* src = kAddResidual ? rr : xr;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec16<T> v, w;
    v.raw = *reinterpret_cast<const uint4*>(src + i * kVec);
    w.raw = *reinterpret_cast<const uint4*>(weight + i * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float normed = round_to<T>(to_float(v.e[j]) * inv_rms);
      v.e[j] = from_float<T>(to_float(w.e[j]) * normed);
    }
    *reinterpret_cast<uint4*>(yr + i * kVec) = v.raw;
  }
}

template <typename T>
cudaError_t launch_rms_norm(void* out, const void* x, void* residual, const void* weight, int64_t rows,
                            int64_t hidden, int64_t out_stride, int64_t x_stride, int64_t residual_stride,
                            float eps, cudaStream_t stream) {
  const int nvec = static_cast<int>(hidden / kVec);
  int threads = ((nvec + 31) / 32) * 32;
  threads = threads < 32 ? 32 : (threads > 1024 ? 1024 : threads);
  const dim3 grid(static_cast<unsigned>(rows));
  if (residual != nullptr) {
    rms_norm_kernel<T, true><<<grid, threads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), static_cast<T*>(residual), static_cast<const T*>(weight),
        static_cast<int>(hidden), out_stride, x_stride, residual_stride, eps);
  } else {
    rms_norm_kernel<T, false><<<grid, threads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), nullptr, static_cast<const T*>(weight),
        static_cast<int>(hidden), out_stride, x_stride, 0, eps);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rms_norm(void* out, const void* x, void* residual, const void* weight, DType dtype, int64_t rows,
                     int64_t hidden, int64_t out_stride, int64_t x_stride, int64_t residual_stride, float eps,
                     cudaStream_t stream) {
  if (hidden % kVec != 0 || hidden <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return ROLLOUT_DISPATCH_HALF(dtype, T, [&] {
    return launch_rms_norm<T>(out, x, residual, weight, rows, hidden, out_stride, x_stride, residual_stride, eps,
                              stream);
  });
}

}  // namespace rollout_kernels
