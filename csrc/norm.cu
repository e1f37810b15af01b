// RMSNorm and fused residual-add + RMSNorm, one CTA per row, 16-byte vectors, float32 math.
// Rounding follows the torch reference (HF Llama): the residual sum is rounded to T, the normalised
// value is rounded to T before the weight multiply, whose product is rounded again.
// kQuant: the output is not stored in T but quantized to e4m3 per row (fp8.cuh) for an FP8 product: a third
// pass recomputes the outputs once their amax is known (cheaper than a second launch reading them back).
#include "fp8.cuh"

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

// weight * round(v * inv_rms) for vector i of a row, rounded as the reference rounds.
template <typename T>
__device__ __forceinline__ Vec16<T> normed_vec(const T* src, const T* weight, int i, float inv_rms) {
  Vec16<T> v, w;
  v.raw = *reinterpret_cast<const uint4*>(src + i * kVec);
  w.raw = *reinterpret_cast<const uint4*>(weight + i * kVec);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float normed = round_to<T>(to_float(v.e[j]) * inv_rms);
    v.e[j] = from_float<T>(to_float(w.e[j]) * normed);
  }
  return v;
}

template <typename T, bool kAddResidual, bool kQuant>
__global__ void rms_norm_kernel(T* __restrict__ out, uint8_t* __restrict__ q, float* __restrict__ q_scale,
                                const T* __restrict__ x, T* residual, const T* __restrict__ weight, int hidden,
                                int64_t out_stride, int64_t x_stride, int64_t residual_stride, float eps) {
  __shared__ float scratch[32];
  dependent_prologue();
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
  float amax = 0.f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec16<T> v = normed_vec(src, weight, i, inv_rms);
    if constexpr (kQuant) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) amax = nan_max(amax, fabsf(to_float(v.e[j])));
    } else {
      *reinterpret_cast<uint4*>(yr + i * kVec) = v.raw;
    }
  }
  if constexpr (kQuant) {
    const float s = e4m3_scale(block_amax(amax, scratch));
    if (threadIdx.x == 0) q_scale[row] = s;
    uint8_t* qr = q + row * hidden;
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      Vec16<T> v = normed_vec(src, weight, i, inv_rms);
      float f[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) f[j] = to_float(v.e[j]);
      *reinterpret_cast<uint2*>(qr + i * kVec) = to_e4m3x8(f, s);
    }
  }
}

template <typename T, bool kQuant>
cudaError_t launch_rms_norm(void* out, uint8_t* q, float* q_scale, const void* x, void* residual,
                            const void* weight, int64_t rows, int64_t hidden, int64_t out_stride, int64_t x_stride,
                            int64_t residual_stride, float eps, cudaStream_t stream) {
  const int threads = fp8_row_threads(hidden);
  const dim3 grid(static_cast<unsigned>(rows));
  if (residual != nullptr) {
    return launch_dependent(rms_norm_kernel<T, true, kQuant>, grid, dim3(threads), 0, stream,
                            static_cast<T*>(out), q, q_scale, static_cast<const T*>(x), static_cast<T*>(residual),
                            static_cast<const T*>(weight), static_cast<int>(hidden), out_stride, x_stride,
                            residual_stride, eps);
  }
  return launch_dependent(rms_norm_kernel<T, false, kQuant>, grid, dim3(threads), 0, stream, static_cast<T*>(out),
                          q, q_scale, static_cast<const T*>(x), static_cast<T*>(nullptr),
                          static_cast<const T*>(weight), static_cast<int>(hidden), out_stride, x_stride,
                          int64_t(0), eps);
}

}  // namespace

cudaError_t rms_norm(void* out, const void* x, void* residual, const void* weight, DType dtype, int64_t rows,
                     int64_t hidden, int64_t out_stride, int64_t x_stride, int64_t residual_stride, float eps,
                     cudaStream_t stream) {
  if (hidden % kVec != 0 || hidden <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return ROLLOUT_DISPATCH_HALF(dtype, T, [&] {
    return launch_rms_norm<T, false>(out, nullptr, nullptr, x, residual, weight, rows, hidden, out_stride,
                                     x_stride, residual_stride, eps, stream);
  });
}

cudaError_t rms_norm_fp8(void* q, float* q_scale, const void* x, void* residual, const void* weight, DType dtype,
                         int64_t rows, int64_t hidden, int64_t x_stride, int64_t residual_stride, float eps,
                         cudaStream_t stream) {
  if (hidden % kVec != 0 || hidden <= 0 || hidden > 0x7fffffff) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return ROLLOUT_DISPATCH_HALF(dtype, T, [&] {
    return launch_rms_norm<T, true>(nullptr, static_cast<uint8_t*>(q), q_scale, x, residual, weight, rows, hidden,
                                    0, x_stride, residual_stride, eps, stream);
  });
}

}  // namespace rollout_kernels
