// Gumbel-max sampling over a whole vocabulary in one pass: token[b] = argmax_v x[b, v] + gumbel(key[b], v).
//
// The noise is the counter-based hash of rollout_service/engine/random.py, made in registers: the torch
// reference builds it as ~25 elementwise passes over [B, V] int64 tensors (~11 GB of traffic at B = 256,
// V = 152k, milliseconds per step), this reads the logits once. The float steps are the reference's, op for
// op and without fast math, so the noise is the reference's on the GPU and so are the tokens (tests/gpu).
// argmax follows torch: NaN counts as the largest value, ties go to the smallest index.
#include <algorithm>
#include <cfloat>

#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

constexpr int kSampleThreads = 512;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// random.py gumbel(): w = (top 32 bits of the hash + 0.5) * 2^-32, at most 1 - 2^-24; g = -log(-log1p(-w)).
__device__ __forceinline__ float gumbel_noise(uint64_t key, int64_t v) {
  const uint64_t h = splitmix64(key + uint64_t(v + 1) * kGolden);
  float w = __uint2float_rn(static_cast<uint32_t>(h >> 32));
  w = __fmul_rn(__fadd_rn(w, 0.5f), 2.3283064365386963e-10f);  // _rn: no contraction into an FMA
  w = fminf(w, 0.99999994039535522f);                           // 1 - 2^-24
  return -logf(-log1pf(-w));
}

// Whether (a, ia) beats (b, ib) under torch's argmax order.
__device__ __forceinline__ bool beats(float a, int64_t ia, float b, int64_t ib) {
  if (isnan(a)) return !isnan(b) || ia < ib;
  if (isnan(b)) return false;
  return a > b || (a == b && ia < ib);
}

struct Best {
  float value;
  int64_t index;
};

__device__ __forceinline__ Best better(Best a, Best b) { return beats(b.value, b.index, a.value, a.index) ? b : a; }

__device__ Best block_best(Best mine) {
  __shared__ float values[kSampleThreads / 32];
  __shared__ int64_t indices[kSampleThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const Best other{__shfl_xor_sync(0xffffffffu, mine.value, o), __shfl_xor_sync(0xffffffffu, mine.index, o)};
    mine = better(mine, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    values[warp] = mine.value;
    indices[warp] = mine.index;
  }
  __syncthreads();
  if (warp == 0) {
    mine = lane < kSampleThreads / 32 ? Best{values[lane], indices[lane]} : Best{-INFINITY, INT64_MAX};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const Best other{__shfl_xor_sync(0xffffffffu, mine.value, o), __shfl_xor_sync(0xffffffffu, mine.index, o)};
      mine = better(mine, other);
    }
  }
  return mine;  // valid in thread 0
}

// CTA (chunk, row): the best of x + noise over its chunk of the row's vocabulary.
__global__ void __launch_bounds__(kSampleThreads) gumbel_argmax_kernel(const GumbelArgmaxParams p) {
  const int c = blockIdx.x;
  const int64_t b = blockIdx.y;
  const float* row = p.x + b * p.row_stride;
  const uint64_t key = static_cast<uint64_t>(p.keys[b]);
  const int64_t end = min(p.vocab, (c + 1) * p.chunk);
  Best best{-INFINITY, INT64_MAX};
  for (int64_t v = c * p.chunk + threadIdx.x; v < end; v += kSampleThreads) {
    const float s = row[v] + gumbel_noise(key, v);
    if (beats(s, v, best.value, best.index)) best = Best{s, v};
  }
  best = block_best(best);
  if (threadIdx.x != 0) return;
  if (p.num_chunks == 1) {
    p.out[b] = best.index;
  } else {
    p.chunk_value[b * p.num_chunks + c] = best.value;
    p.chunk_index[b * p.num_chunks + c] = best.index;
  }
}

// One thread per row: the best chunk, scanned in order.
__global__ void gumbel_argmax_combine_kernel(const GumbelArgmaxParams p) {
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= p.batch) return;
  Best best{-INFINITY, INT64_MAX};
  for (int c = 0; c < p.num_chunks; ++c)
    best = better(best, Best{p.chunk_value[b * p.num_chunks + c], p.chunk_index[b * p.num_chunks + c]});
  p.out[b] = best.index;
}

}  // namespace

int gumbel_argmax_chunks(int64_t batch, int64_t vocab, int num_sms) {
  // ~2 CTAs per SM in all, each with at least 2048 tokens: a batch of one still spreads over the GPU.
  const int64_t want = (2 * int64_t(num_sms) + batch - 1) / batch;
  const int64_t most = (vocab + 2047) / 2048;
  return static_cast<int>(std::max<int64_t>(1, std::min(want, most)));
}

cudaError_t gumbel_argmax(const GumbelArgmaxParams& p, cudaStream_t stream) {
  if (p.batch < 0 || p.vocab <= 0 || p.num_chunks < 1 || p.chunk * p.num_chunks < p.vocab ||
      (p.num_chunks > 1 && (p.chunk_value == nullptr || p.chunk_index == nullptr)) || p.batch > 65535) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  gumbel_argmax_kernel<<<dim3(p.num_chunks, unsigned(p.batch)), kSampleThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_chunks == 1) return err;
  gumbel_argmax_combine_kernel<<<unsigned((p.batch + 127) / 128), 128, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace rollout_kernels
