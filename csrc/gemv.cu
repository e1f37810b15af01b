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
#include <algorithm>

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

}  // namespace

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
    if (p.gated) {
      gemv_kernel<T, true, T><<<blocks, kThreads, 0, stream>>>(p);
    } else if (p.out_float) {
      gemv_kernel<T, false, float><<<blocks, kThreads, 0, stream>>>(p);
    } else {
      gemv_kernel<T, false, T><<<blocks, kThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  });
}

}  // namespace rollout_kernels
