// Linear layers of a batch-1 decode step: out[n] = sum_k x[k] * W[n, k] + bias[n].
//
// At these batches a linear layer is a pure weight stream, and cuBLAS spends 4-7 µs on projections whose
// weights stream in 1-3 µs, some with a second split-K reduce launch (H200: csrc/NOTES.md). Here one warp
// (or `split` warps sharing the K range, when the columns alone leave the chip short of loads in flight) owns
// an output column: it streams that weight row with 16-byte loads, kUnroll in flight per lane, 512 contiguous
// bytes per warp instruction, and reads x through L1. Partial sums are float32 per lane, combined by
// a warp reduce and then across the split warps in a fixed order, and rounded once, so results agree with a
// float32-accumulating GEMM up to summation order.
//
// Rows (blockIdx.y) serve the mixture-of-experts slots of a small decode batch: each slot row streams its own
// expert's weight, so rows share no weight reads for the tensor cores to amortise.
//
// Batch 1 only for dense layers: on CUDA cores the x loads and FMAs grow with the batch; at batch 2 the llama3-8b layers were
// already slower than cuBLAS, at batch 8 about half its speed. A tensor-core variant (16 columns per warp)
// was latency bound at 50-57% of bandwidth at every batch (H200: csrc/NOTES.md).
//
// kGated computes the MLP's gate_up projection and silu_and_mul in one launch: the warp of column n also
// streams weight row n + N (up) and writes silu(gate) * up with the torch reference's roundings.
//
// gemv_fp8 is the FP8 product of ops/fp8.py for one row: e4m3 activations (quantized by fp8.cu or a fused norm /
// SiLU·mul) times an e4m3 weight, float32 sums of the exact products, (sum * x_scale) * w_scale[n] (+ bias),
// rounded once. The weight streams at one byte per element; the hardware e4m3x2 -> f16x2 conversion (sm_89+)
// feeds float32 FMAs, and each warp owns kFp8Cols columns so that one x vector's conversion serves all of them.
#include <algorithm>

#include <cuda_fp8.h>

#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;

// 16-byte read-only loads, zero where !live. Predicated rather than branched, and volatile so they stay in
// source order: a round's loads all issue before its first product (a plain tail loop waited one memory
// latency per vector, which dominated short rows). Weights are read once: with no L1 line, x keeps L1.
#define ROLLOUT_LOAD16(name, op)                                                                   \
  __device__ __forceinline__ uint4 name(const void* ptr, bool live) {                             \
    uint4 v;                                                                                     \
    asm volatile(                                                                                \
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n"          \
        " mov.b32 %2, 0;\n mov.b32 %3, 0;\n @p " op " {%0,%1,%2,%3}, [%4];\n}\n"               \
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                                             \
        : "l"(ptr), "r"(int(live)));                                                             \
    return v;                                                                                    \
  }
ROLLOUT_LOAD16(load_stream, "ld.global.nc.L1::no_allocate.v4.u32")
ROLLOUT_LOAD16(load_cached, "ld.global.nc.v4.u32")
#undef ROLLOUT_LOAD16

// acc[r] += dot(w[r], x) over one 16-byte vector (8 elements).
template <typename T, int R>
__device__ __forceinline__ void dot8(float (&acc)[R], const uint4 (&w)[R], const uint4& x) {
  Vec16<T> xv;
  xv.raw = x;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    Vec16<T> wv;
    wv.raw = w[r];
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[r] = fmaf(to_float(wv.e[j]), to_float(xv.e[j]), acc[r]);
  }
}

template <typename Out>
__device__ __forceinline__ void store(void* out, int64_t idx, float v) {
  static_cast<Out*>(out)[idx] = from_float<Out>(v);
}

template <typename T, bool kGated, typename Out>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const GemvParams p) {
  constexpr int R = kGated ? 2 : 1;  // weight rows per column: gate (and up)
  __shared__ float partial[kWarps][R];
  dependent_prologue();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = blockIdx.x * (kWarps / p.split) + warp / p.split;
  const int part = warp % p.split;
  const int vecs = p.k / kVec;
  const int row = blockIdx.y;
  const T* weight = static_cast<const T*>(p.weight);
  if (p.expert_ids != nullptr) weight += p.expert_ids[row] * p.expert_stride;

  // Columns past n (in the last CTA) read row 0 and are not stored.
  const T* w[R];
#pragma unroll
  for (int r = 0; r < R; ++r) w[r] = weight + (int64_t(col < p.n ? col : 0) + r * p.n) * p.k;
  const T* x = static_cast<const T*>(p.x) + (row / p.x_div) * p.x_stride;
  void* out = static_cast<char*>(p.out) + row * p.out_stride * (p.out_float ? 4 : 2);

  float acc[R] = {};
  const int step = 32 * p.split;
  for (int i = part * 32 + lane; i < vecs; i += kUnroll * step) {
    uint4 wv[kUnroll][R], xv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = i + u * step;
      const bool live = v < vecs;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = load_stream(w[r] + v * kVec, live);
      xv[u] = load_cached(x + v * kVec, live);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dot8<T, R>(acc, wv[u], xv[u]);  // zeros past the end add nothing
  }
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) partial[warp][r] = acc[r];
  }
  __syncthreads();
  // The column's first warp sums its split warps in order and writes the column.
  if (part != 0 || col >= p.n || lane != 0) return;
  float y[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    y[r] = 0.f;
    for (int s = 0; s < p.split; ++s) y[r] += partial[warp + s][r];
    if (p.bias != nullptr) y[r] += to_float(static_cast<const T*>(p.bias)[col + r * p.n]);
  }
  if constexpr (kGated) {
    // As TorchOps.gated_linear: the projection rounded to T, silu rounded to T, the product rounded to T.
    const float gate = round_to<T>(y[0]), up = round_to<T>(y[R - 1]);
    store<Out>(out, col, round_to<T>(gate / (1.f + expf(-gate))) * up);
  } else {
    store<Out>(out, col, y[0]);
  }
}

constexpr int kFp8Cols = 4;   // columns per warp
constexpr int kFp8Vec = 16;   // e4m3 values per 16-byte load
constexpr int kFp8Unroll = 2;  // rounds of loads in flight per lane (kFp8Cols + 1 loads each)

// Sixteen e4m3 values as floats, exactly (e4m3 -> f16 -> f32 loses nothing).
__device__ __forceinline__ void e4m3x16_to_float(const uint4& v, float (&f)[kFp8Vec]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw raw =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * h)), __NV_E4M3);
      const float2 pair = __half22float2(__half2(raw));
      f[4 * i + 2 * h] = pair.x;
      f[4 * i + 2 * h + 1] = pair.y;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) gemv_fp8_kernel(const GemvFp8Params p) {
  __shared__ float partial[kWarps][kFp8Cols];
  dependent_prologue();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = blockIdx.x * (kWarps / p.split) + warp / p.split;
  const int part = warp % p.split;
  const int col0 = group * kFp8Cols;
  const int vecs = p.k / kFp8Vec;
  const uint8_t* weight = static_cast<const uint8_t*>(p.weight);
  const uint8_t* x = static_cast<const uint8_t*>(p.x);
  // Columns past n (in the last group) read row 0 and are not stored.
  const uint8_t* w[kFp8Cols];
#pragma unroll
  for (int c = 0; c < kFp8Cols; ++c) w[c] = weight + int64_t(col0 + c < p.n ? col0 + c : 0) * p.k;

  float acc[kFp8Cols] = {};
  const int step = 32 * p.split;
  for (int i = part * 32 + lane; i < vecs; i += kFp8Unroll * step) {
    uint4 wv[kFp8Unroll][kFp8Cols], xv[kFp8Unroll];
#pragma unroll
    for (int u = 0; u < kFp8Unroll; ++u) {
      const int v = i + u * step;
      const bool live = v < vecs;
#pragma unroll
      for (int c = 0; c < kFp8Cols; ++c) wv[u][c] = load_stream(w[c] + int64_t(v) * kFp8Vec, live);
      xv[u] = load_cached(x + int64_t(v) * kFp8Vec, live);
    }
#pragma unroll
    for (int u = 0; u < kFp8Unroll; ++u) {  // zeros past the end add nothing
      float xf[kFp8Vec];
      e4m3x16_to_float(xv[u], xf);
#pragma unroll
      for (int c = 0; c < kFp8Cols; ++c) {
        float wf[kFp8Vec];
        e4m3x16_to_float(wv[u][c], wf);
#pragma unroll
        for (int j = 0; j < kFp8Vec; ++j) acc[c] = fmaf(wf[j], xf[j], acc[c]);
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kFp8Cols; ++c) acc[c] = warp_sum(acc[c]);
  if (lane == 0) {
#pragma unroll
    for (int c = 0; c < kFp8Cols; ++c) partial[warp][c] = acc[c];
  }
  __syncthreads();
  // Lane c of the group's first warp sums column c's split warps in order and writes it.
  const int col = col0 + lane;
  if (part != 0 || lane >= kFp8Cols || col >= p.n) return;
  float y = 0.f;
  for (int s = 0; s < p.split; ++s) y += partial[warp + s][lane];
  y = y * p.x_scale[0] * p.w_scale[col];
  if (p.bias != nullptr) y += to_float(static_cast<const T*>(p.bias)[col]);
  static_cast<T*>(p.out)[col] = from_float<T>(y);
}

}  // namespace

int gemv_fp8_split(int n, int k, int num_sms) {
  return gemv_split((int64_t(n) + kFp8Cols - 1) / kFp8Cols, k / 2, num_sms);  // k / 2: a load holds 16, not 8
}

cudaError_t gemv_fp8(const GemvFp8Params& p, cudaStream_t stream) {
  if (p.k <= 0 || p.k % kFp8Vec != 0 || p.n < 0 || p.split < 1 || p.split > kWarps || (p.split & (p.split - 1)) != 0) {
    return cudaErrorInvalidValue;
  }
  if (p.n == 0) return cudaSuccess;
  const int64_t groups = (int64_t(p.n) + kFp8Cols - 1) / kFp8Cols;
  const dim3 blocks(unsigned((groups * p.split + kWarps - 1) / kWarps));
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    return launch_dependent(gemv_fp8_kernel<T>, blocks, dim3(kThreads), 0, stream, p);
  });
}

int gemv_split(int64_t columns, int k, int num_sms) {
  // Split K over more warps while the chip still has room for them (64 warps per SM) and each warp keeps at
  // least two rounds of kUnroll loads per lane.
  const int vecs = k / kVec;
  int split = 1;
  while (split < kWarps && columns * split * 2 <= int64_t(num_sms) * 64 && vecs >= 32 * kUnroll * split * 2) {
    split *= 2;
  }
  return split;
}

cudaError_t gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.k <= 0 || p.k % kVec != 0 || p.n < 0 || p.split < 1 || p.split > kWarps || (p.split & (p.split - 1)) != 0 ||
      (p.gated && p.out_float) || p.rows < 0 || p.rows > 65535 || p.x_div < 1 ||
      (p.expert_ids != nullptr && p.bias != nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.n == 0 || p.rows == 0) return cudaSuccess;
  const dim3 blocks(unsigned((int64_t(p.n) * p.split + kWarps - 1) / kWarps), unsigned(p.rows));
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.gated) return launch_dependent(gemv_kernel<T, true, T>, blocks, dim3(kThreads), 0, stream, p);
    if (p.out_float) return launch_dependent(gemv_kernel<T, false, float>, blocks, dim3(kThreads), 0, stream, p);
    return launch_dependent(gemv_kernel<T, false, T>, blocks, dim3(kThreads), 0, stream, p);
  });
}

}  // namespace rollout_kernels
