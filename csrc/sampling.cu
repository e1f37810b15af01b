// Gumbel-max sampling over a whole vocabulary in one pass: token[b] = argmax_v x[b, v] + gumbel(key[b], v).
//
// The noise is the counter-based hash of rollout_service/ops/random.py, made in registers: the torch
// reference builds it as ~25 elementwise passes over [B, V] int64 tensors (~11 GB of traffic at B = 256,
// V = 152k, milliseconds per step), this reads the logits once. The float steps are the reference's, op for
// op and without fast math, so the noise is the reference's on the GPU and so are the tokens (tests/gpu).
// argmax follows torch: NaN counts as the largest value, ties go to the smallest index.
//
// argmax_logsumexp, for plain greedy decoding: torch's x.max(dim=1) and x.logsumexp(dim=1) in one read of
// the logits (torch takes ~7 passes: logsumexp materialises x - max and its exp). Its chunks of a row are a
// constant number of tokens, so a row's results are bitwise the same whatever the batch.
#include <algorithm>
#include <cfloat>
#include <cstdint>

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
  dependent_prologue();
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
  dependent_prologue();
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= p.batch) return;
  Best best{-INFINITY, INT64_MAX};
  for (int c = 0; c < p.num_chunks; ++c)
    best = better(best, Best{p.chunk_value[b * p.num_chunks + c], p.chunk_index[b * p.num_chunks + c]});
  p.out[b] = best.index;
}

// ---- argmax and logsumexp in one pass ------------------------------------------------------------

constexpr int kLseThreads = 256;
constexpr int kLseUnroll = 4;                               // float4 loads in flight per thread
constexpr int kLseStride = 4 * kLseThreads;                 // tokens between a thread's float4 loads
constexpr int kLseStep = kLseStride * kLseUnroll;           // tokens a CTA reads per iteration
constexpr int64_t kLseChunk = 2 * kLseStep;                 // tokens per CTA: never a function of the batch
constexpr int64_t kNoIndex = INT64_MAX;

// A stretch of a row: its torch.max (best) and the sum of exp(x - best.value) over it. Once best.value is
// NaN or +inf the sum means nothing: the row's logsumexp is then best.value itself.
struct MaxSum {
  Best best;
  float sum;
};

// The value the exponentials are taken against: like torch.logsumexp, 0 for an infinite max, so an all
// -inf stretch sums exp(-inf - 0) = 0 instead of exp(NaN).
__device__ __forceinline__ float exp_shift(float max) { return isinf(max) ? 0.f : max; }

__device__ __forceinline__ MaxSum merge(const MaxSum& a, const MaxSum& b) {
  const Best best = better(a.best, b.best);
  const float shift = exp_shift(best.value);
  return {best, a.sum * expf(a.best.value - shift) + b.sum * expf(b.best.value - shift)};
}

// torch.logsumexp's special values: a NaN gives NaN, else a +inf gives +inf, an all -inf row gives -inf.
__device__ __forceinline__ float row_lse(const MaxSum& a) {
  return isnan(a.best.value) || isinf(a.best.value) ? a.best.value : a.best.value + logf(a.sum);
}

// Four tokens from v on; those at or past `end` read as -inf (a zero term, never a winner: see fold).
__device__ __forceinline__ void load_quad(const float* row, int64_t v, int64_t end, bool aligned, float (&q)[4]) {
  if (aligned && v + 4 <= end) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(row + v));
    q[0] = f.x;
    q[1] = f.y;
    q[2] = f.z;
    q[3] = f.w;
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) q[k] = v + k < end ? __ldg(row + v + k) : -INFINITY;
}

// Folds one iteration's tokens, x[u][k] at base + u * kLseStride + k (increasing ids), into acc. Only a
// later token strictly greater (or a first NaN) moves the argmax, so the winner search runs only when the
// group's max beats acc's. The first token, at base, is always in the row: a -inf past the row's end can
// never be the first -inf of an all -inf stretch.
__device__ __forceinline__ void fold(MaxSum& acc, const float (&x)[kLseUnroll][4], int64_t base) {
  float top = -INFINITY;
  bool nan = false;
#pragma unroll
  for (int u = 0; u < kLseUnroll; ++u) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      top = fmaxf(top, x[u][k]);
      nan |= isnan(x[u][k]);
    }
  }
  const float before = acc.best.value;
  if (nan) {  // rows with a NaN only: torch's order, token by token
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int64_t v = base + u * kLseStride + k;
        if (beats(x[u][k], v, acc.best.value, acc.best.index)) acc.best = Best{x[u][k], v};
      }
    }
  } else if (top > before || (top == before && acc.best.index == kNoIndex)) {
    // the first token equal to the max (its own bits: fmaxf may pick +0 over an earlier -0)
    int first = 0;
    float value = top;
#pragma unroll
    for (int i = kLseUnroll * 4 - 1; i >= 0; --i) {
      if (x[i / 4][i % 4] == top) {
        first = (i / 4) * kLseStride + i % 4;
        value = x[i / 4][i % 4];
      }
    }
    acc.best = Best{value, base + first};
  }
  const float shift = exp_shift(acc.best.value);
  float sum = acc.sum * expf(before - shift);
#pragma unroll
  for (int u = 0; u < kLseUnroll; ++u) {
#pragma unroll
    for (int k = 0; k < 4; ++k) sum += expf(x[u][k] - shift);
  }
  acc.sum = sum;
}

__device__ __forceinline__ MaxSum warp_merge(MaxSum mine) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const MaxSum other{{__shfl_xor_sync(0xffffffffu, mine.best.value, o), __shfl_xor_sync(0xffffffffu, mine.best.index, o)},
                       __shfl_xor_sync(0xffffffffu, mine.sum, o)};
    mine = merge(mine, other);
  }
  return mine;
}

__device__ MaxSum block_merge(MaxSum mine) {
  __shared__ MaxSum warps[kLseThreads / 32];
  mine = warp_merge(mine);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < kLseThreads / 32 ? warps[lane] : MaxSum{{-INFINITY, kNoIndex}, 0.f};
    mine = warp_merge(mine);
  }
  return mine;  // valid in thread 0
}

__device__ __forceinline__ void write_row(const ArgmaxLogsumexpParams& p, int64_t b, const MaxSum& r) {
  p.tokens[b] = r.best.index;
  p.values[b] = r.best.value;
  p.lse[b] = row_lse(r);
}

// CTA (chunk, row). Every thread reads the same token positions whether the row is 16-byte aligned or not
// (float4 or scalar loads), so a row's sums do not depend on where it lies in memory either.
__global__ void __launch_bounds__(kLseThreads) argmax_logsumexp_kernel(const ArgmaxLogsumexpParams p, int num_chunks) {
  dependent_prologue();
  const int64_t c = blockIdx.x, b = blockIdx.y;
  const float* row = p.x + b * p.row_stride;
  const bool aligned = reinterpret_cast<uintptr_t>(row) % 16 == 0;
  const int64_t end = min(p.vocab, (c + 1) * kLseChunk);
  MaxSum acc{{-INFINITY, kNoIndex}, 0.f};
  for (int64_t base = c * kLseChunk + 4 * threadIdx.x; base < end; base += kLseStep) {
    float x[kLseUnroll][4];
#pragma unroll
    for (int u = 0; u < kLseUnroll; ++u) load_quad(row, base + u * kLseStride, end, aligned, x[u]);
    fold(acc, x, base);
  }
  acc = block_merge(acc);
  if (threadIdx.x != 0) return;
  if (num_chunks == 1) {
    write_row(p, b, acc);
  } else {
    p.chunk_value[b * num_chunks + c] = acc.best.value;
    p.chunk_index[b * num_chunks + c] = acc.best.index;
    p.chunk_sum[b * num_chunks + c] = acc.sum;
  }
}

// One thread per row: the chunks merged in order.
__global__ void argmax_logsumexp_combine_kernel(const ArgmaxLogsumexpParams p, int num_chunks) {
  dependent_prologue();
  const int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (b >= p.batch) return;
  MaxSum acc{{-INFINITY, kNoIndex}, 0.f};
  for (int c = 0; c < num_chunks; ++c) {
    const int64_t i = b * num_chunks + c;
    acc = merge(acc, MaxSum{{p.chunk_value[i], p.chunk_index[i]}, p.chunk_sum[i]});
  }
  write_row(p, b, acc);
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
  const cudaError_t err = launch_dependent(gumbel_argmax_kernel, dim3(p.num_chunks, unsigned(p.batch)),
                                           dim3(kSampleThreads), 0, stream, p);
  if (err != cudaSuccess || p.num_chunks == 1) return err;
  return launch_dependent(gumbel_argmax_combine_kernel, dim3(unsigned((p.batch + 127) / 128)), dim3(128), 0, stream, p);
}

int64_t argmax_logsumexp_chunks(int64_t vocab) { return (vocab + kLseChunk - 1) / kLseChunk; }

cudaError_t argmax_logsumexp(const ArgmaxLogsumexpParams& p, cudaStream_t stream) {
  const int64_t chunks = argmax_logsumexp_chunks(p.vocab);
  if (p.batch < 0 || p.batch > 65535 || p.vocab <= 0 || chunks > INT32_MAX) return cudaErrorInvalidValue;
  if (p.batch == 0) return cudaSuccess;  // before the pointer checks: empty tensors may have null data
  if (p.x == nullptr || p.tokens == nullptr || p.values == nullptr || p.lse == nullptr ||
      (chunks > 1 && (p.chunk_value == nullptr || p.chunk_index == nullptr || p.chunk_sum == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const int num_chunks = static_cast<int>(chunks);
  const cudaError_t err = launch_dependent(argmax_logsumexp_kernel, dim3(unsigned(num_chunks), unsigned(p.batch)),
                                           dim3(kLseThreads), 0, stream, p, num_chunks);
  if (err != cudaSuccess || num_chunks == 1) return err;
  return launch_dependent(argmax_logsumexp_combine_kernel, dim3(unsigned((p.batch + 127) / 128)), dim3(128), 0,
                          stream, p, num_chunks);
}

}  // namespace rollout_kernels
