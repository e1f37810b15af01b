// RMSNorm's pieces, shared by the norm kernels (norm.cu) and the gemv that folds the norm into its prologue
// (gemv.cu), so both round exactly as the torch reference (HF Llama) does: the residual sum rounded to T, the
// normalised value rounded to T before the weight multiply, whose product is rounded again.
#pragma once

#include "kernel_utils.cuh"

namespace rollout_kernels {

// The sum of v over the CTA; every thread gets it. scratch: 32 floats of shared memory, used once per CTA.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.f;
  return warp_sum(v);  // every warp reduces the partials, so no second broadcast is needed
}

// weight * round(v * inv_rms) for vector i of a row (src in global or shared memory), rounded as the reference.
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

}  // namespace rollout_kernels
