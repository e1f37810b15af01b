// FP8 (e4m3) activation quantization shared by the kernels that end in it (fp8.cu's plain quantize, norm.cu's
// norm + quantize, activation.cu's SiLU·mul + quantize): the arithmetic of rollout_service/ops/fp8.py's
// quantize_rows, so a fused kernel writes bitwise what the reference would from the same row.
//   scale = amax / 448 (IEEE division; 1 for an all-zero row), q = e4m3(x / scale) (IEEE division, round to
//   nearest even, saturating: the reference clamps to +-448 first). NaN propagates through amax as in torch.
#pragma once

#include <cuda_fp8.h>

#include "kernel_utils.cuh"

namespace rollout_kernels {

constexpr float kE4M3Max = 448.f;

// max that keeps a NaN from either side (fmaxf drops it; torch's amax does not).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ float warp_nan_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The row's amax over the CTA (every thread gets it). scratch: 32 floats of shared memory.
__device__ __forceinline__ float block_amax(float v, float* scratch) {
  v = warp_nan_max(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // scratch may still be read by an earlier reduction of the same CTA
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_nan_max(lane < warps ? scratch[lane] : 0.f);
}

__device__ __forceinline__ float e4m3_scale(float amax) { return amax > 0.f ? __fdiv_rn(amax, kE4M3Max) : 1.f; }

__device__ __forceinline__ uint8_t to_e4m3(float v, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v, scale), __NV_SATFINITE, __NV_E4M3));
}

// Eight values (one 16-byte vector of T) as eight e4m3 bytes, first value in the lowest byte.
__device__ __forceinline__ uint2 to_e4m3x8(const float (&v)[kVec], float scale) {
  uint32_t word[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < kVec; ++j) word[j / 4] |= uint32_t(to_e4m3(v[j], scale)) << (8 * (j % 4));
  return make_uint2(word[0], word[1]);
}

}  // namespace rollout_kernels
