// Device helpers shared by the .cu files: dtype conversion, 16-byte vectors, cp.async, ldmatrix, mma.sync.
// Written without the half/bfloat16 operators because torch builds with __CUDA_NO_*_OPERATORS__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "kernels.h"

namespace rollout_kernels {

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

// Round a float through T and back: reproduces a torch op computed in T.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// Eight 2-byte elements as one 16-byte vector (the norm and activation kernels' loads and stores).
constexpr int kVec = 8;

template <typename T>
union Vec16 {
  uint4 raw;
  T e[kVec];
};

// Two floats as one 32-bit register of two T, the first in the low half (the MMA operand order).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// P·V with probabilities that keep float32 precision through a T-only MMA: P is written as a sum of parts
// in T (each part the rounding of what the previous ones left) and multiplied one MMA per part. bf16 needs
// three parts (8 significant bits each), fp16 two (11 each). With fewer bits (two bf16 parts, ~2^-18
// relative) about 0.2% of the bf16 outputs round differently from the exact result; with these, no more
// often than the float32 torch reference's (measured: csrc/NOTES.md).
template <typename T>
struct PParts {
  static constexpr int kNum = 3;
};
template <>
struct PParts<__half> {
  static constexpr int kNum = 2;
};

// The two floats of a packed pair of T (low half first), exactly.
template <typename T>
__device__ __forceinline__ void unpack2(uint32_t v, float& lo, float& hi);
template <>
__device__ __forceinline__ void unpack2<__nv_bfloat16>(uint32_t v, float& lo, float& hi) {
  lo = __uint_as_float(v << 16);  // a bf16 is the high half of its float
  hi = __uint_as_float(v & 0xffff0000u);
}
template <>
__device__ __forceinline__ void unpack2<__half>(uint32_t v, float& lo, float& hi) {
  const __half2 h = *reinterpret_cast<const __half2*>(&v);
  lo = __low2float(h);
  hi = __high2float(h);
}

// Parts of the pair (a, b) into register `reg` of each part's A fragment (kNum = 1: plain rounding to T).
template <typename T, int kNum = PParts<T>::kNum>
__device__ __forceinline__ void split_p(float a, float b, uint32_t (&frag)[kNum][4], int reg) {
#pragma unroll
  for (int i = 0; i < kNum; ++i) {
    frag[i][reg] = pack2<T>(a, b);
    if (i + 1 < kNum) {
      float ra, rb;
      unpack2<T>(frag[i][reg], ra, rb);
      a -= ra;
      b -= rb;
    }
  }
}

// 2^x with the hardware approximation (rel. error ~2^-22, far under bf16/fp16 rounding); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Programmatic dependent launch (sm_90+): a kernel lets the next kernel in the stream, launched with
// cudaLaunchAttributeProgrammaticStreamSerialization, start launching before it finishes; that kernel waits
// for the first one's completion and writes before it reads them. Both are no-ops before sm_90.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The prologue of a kernel launched with launch_dependent: wait for the previous kernel's writes, then let the
// next kernel start its launch (it waits for ours in turn, so the chain stays ordered).
__device__ __forceinline__ void dependent_prologue() {
  wait_for_previous_grid();
  allow_dependent_launch();
}

// Whether the current device runs programmatic dependent launch (sm_90+), unless ROLLOUT_PDL=0 turns it off
// (to measure what it gives). Cached per device.
inline bool supports_dependent_launch() {
  static const bool enabled = [] {
    const char* v = std::getenv("ROLLOUT_PDL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  static int major[64] = {};
  int dev = 0;
  if (!enabled || cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (major[dev] == 0 && cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
    return false;
  return major[dev] >= 9;
}

// Launch a kernel that begins with dependent_prologue() so that its launch overlaps the tail of the kernel
// before it in the stream (sm_90+; a plain launch elsewhere). A batch-1 decode step is ~200 short kernels:
// each boundary otherwise costs its full launch latency. CUDA graph capture keeps the programmatic edges.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args&&... args) {
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = supports_dependent_launch() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy that bypasses L1; when !valid the destination is zero-filled
// (src must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lane i gives the row address of matrix i/8, row i%8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// c[16x8] += a[16x16] * b[16x8], float32 accumulate (m16n8k16, A row-major, B column-major).
template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the 4 lanes of an MMA quad (lanes sharing a fragment row).
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// One online-softmax step for a thread's two MMA rows, given each row's max over the new tile (this thread's
// share; the quad is reduced here): updates the running max m and sum l, returns in m_use the value to
// subtract before exp2 (0 for a row with nothing visible yet, which then stays all-zero) and in corr the
// factor that rescales what was accumulated so far.
__device__ __forceinline__ void online_softmax_step(float (&m)[2], float (&l)[2], const float (&tile_max)[2],
                                                    float (&m_use)[2], float (&corr)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = fmaxf(m[r], quad_max(tile_max[r]));
    m_use[r] = m_new == -INFINITY ? 0.f : m_new;
    corr[r] = fast_exp2(m[r] - m_use[r]);
    m[r] = m_new;
    l[r] *= corr[r];
  }
}

// Dispatch a runtime DType to a template on the element type (bf16 or fp16 only).
#define ROLLOUT_DISPATCH_HALF(dtype, T, ...)                 \
  [&]() -> cudaError_t {                                    \
    if ((dtype) == DType::kBFloat16) {                      \
      using T = __nv_bfloat16;                              \
      return __VA_ARGS__();                                 \
    }                                                       \
    if ((dtype) == DType::kFloat16) {                       \
      using T = __half;                                     \
      return __VA_ARGS__();                                 \
    }                                                       \
    return cudaErrorInvalidValue;                           \
  }()

}  // namespace rollout_kernels
