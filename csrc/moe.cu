// Mixture-of-experts around the experts' products: routing, the permutation into expert order, and the
// weighted sum of a token's k expert outputs. Semantics: rollout_service/ops/moe.py (the torch reference).
//
// - moe_route: one warp per token over the router's logits (rounded to the model dtype, as the reference's
//   product leaves them): float32 softmax with accurate expf and an IEEE division, top-k largest first (the lower
//   expert id first on a tie), optionally renormalised by adds in slot order. With a routing table it also
//   writes the ids at the token's KV slot (routing replay's record), so no second launch does it.
// - moe_permute: one CTA per expert. It counts the rows routed to experts before it (its offset) and to itself,
//   then walks the (token, slot) list in order, so the rows of an expert keep the order of the reference's
//   stable sort, and copies each row into the grouped buffer. Nothing comes back to the host: the offsets are
//   what torch._grouped_mm takes, and a CUDA graph can capture the step.
// - moe_combine: out[t] = sum over slots s of w[t, s] * y[row(t, s)] in float32, each product and each add
//   rounded as the reference's separate torch ops round them (no FMA contraction), then rounded once to T.
#include <cmath>

#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

constexpr int kRouteWarps = 4;
constexpr int kPerLane = kMoeMaxExperts / 32;
constexpr int kPermuteThreads = 256;
constexpr int kPermuteWarps = kPermuteThreads / 32;
constexpr int kCombineThreads = 256;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The better of two (probability, id) candidates: larger probability, then lower id.
__device__ __forceinline__ bool better(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

template <typename T>
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const MoeRouteParams p) {
  dependent_prologue();
  const int token = blockIdx.x * kRouteWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (token >= p.tokens) return;
  const T* row = static_cast<const T*>(p.logits) + int64_t(token) * p.logits_stride;
  float v[kPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * 32 + lane;
    v[i] = e < p.experts ? to_float(row[e]) : -INFINITY;
    m = fmaxf(m, v[i]);
  }
  m = warp_max(m);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = i * 32 + lane < p.experts ? expf(v[i] - m) : 0.f;
    sum += v[i];
  }
  sum = warp_sum(sum);  // a butterfly: every lane ends with the same bits (each add is commutative)
  bool nan = false;  // a NaN or infinite logit: the reference's softmax gives NaN there too
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    v[i] = i * 32 + lane < p.experts ? v[i] / sum : -1.f;  // -1: no expert
    nan |= isnan(v[i]);
  }
  nan = __any_sync(0xffffffffu, nan);

  float w[kMoeMaxTopK];
  int ids[kMoeMaxTopK];
#pragma unroll
  for (int s = 0; s < kMoeMaxTopK; ++s) {
    if (s >= p.top_k) break;
    float best = -2.f;
    int best_id = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (better(v[i], i * 32 + lane, best, best_id)) best = v[i], best_id = i * 32 + lane;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, best_id, o);
      if (better(ob, oi, best, best_id)) best = ob, best_id = oi;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (i * 32 + lane == best_id) v[i] = -2.f;  // taken
    }
    w[s] = best;
    ids[s] = best_id;
  }
  if (lane != 0) return;
  if (p.renormalize) {
    float total = w[0];
#pragma unroll
    for (int s = 1; s < kMoeMaxTopK; ++s) {
      if (s < p.top_k) total = __fadd_rn(total, w[s]);
    }
#pragma unroll
    for (int s = 0; s < kMoeMaxTopK; ++s) {
      if (s < p.top_k) w[s] = __fdiv_rn(w[s], total);
    }
  }
  const int64_t slot = p.record != nullptr ? p.slots[token] : -1;
#pragma unroll
  for (int s = 0; s < kMoeMaxTopK; ++s) {
    if (s >= p.top_k) break;
    const int64_t at = int64_t(token) * p.top_k + s;
    // a row whose probabilities are NaN has no ranking: NaN weights, ids 0..k-1
    p.ids[at] = nan ? s : ids[s];
    p.weights[at] = nan ? NAN : w[s];
    if (slot >= 0) {
      const int id = nan ? s : ids[s];
      if (p.record_wide) {
        static_cast<int16_t*>(p.record)[slot * p.record_stride + s] = static_cast<int16_t>(static_cast<uint16_t>(id));
      } else {
        static_cast<uint8_t*>(p.record)[slot * p.record_stride + s] = static_cast<uint8_t>(id);
      }
    }
  }
}

__device__ __forceinline__ int block_sum(int v, int* scratch) {
  v = __reduce_add_sync(0xffffffffu, v);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  int total = 0;
#pragma unroll
  for (int w = 0; w < kPermuteWarps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kPermuteThreads) moe_permute_kernel(const MoePermuteParams p) {
  __shared__ int scratch[kPermuteWarps];
  __shared__ int chunk_pos[kPermuteThreads], chunk_token[kPermuteThreads];
  dependent_prologue();
  const int expert = blockIdx.x, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  int before = 0, mine = 0;
  for (int j = tid; j < p.slots; j += kPermuteThreads) {
    const int id = p.ids[j];
    before += id < expert;
    mine += id == expert;
  }
  before = block_sum(before, scratch);
  mine = block_sum(mine, scratch);
  if (tid == 0) p.offsets[expert] = before + mine;
  if (mine == 0) return;  // the whole CTA agrees

  const T* x = static_cast<const T*>(p.x);
  T* grouped = static_cast<T*>(p.grouped);
  const int vecs = p.hidden / kVec;
  int base = before;
  for (int chunk = 0; chunk < p.slots; chunk += kPermuteThreads) {
    const int j = chunk + tid;
    const bool match = j < p.slots && p.ids[j] == expert;
    const unsigned ballot = __ballot_sync(0xffffffffu, match);
    if (lane == 0) scratch[warp] = __popc(ballot);
    __syncthreads();
    int rank = 0, found = 0;
#pragma unroll
    for (int w = 0; w < kPermuteWarps; ++w) {
      rank += w < warp ? scratch[w] : 0;
      found += scratch[w];
    }
    if (match) {
      rank += __popc(ballot & ((1u << lane) - 1u));
      p.position[j] = base + rank;
      chunk_pos[rank] = base + rank;
      chunk_token[rank] = j / p.top_k;
    }
    __syncthreads();
    for (int i = tid; i < found * vecs; i += kPermuteThreads) {
      const int r = i / vecs, v = i % vecs;
      *reinterpret_cast<uint4*>(grouped + int64_t(chunk_pos[r]) * p.hidden + v * kVec) =
          *reinterpret_cast<const uint4*>(x + int64_t(chunk_token[r]) * p.x_stride + v * kVec);
    }
    base += found;
    __syncthreads();  // scratch and the chunk lists are rewritten next round
  }
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const MoeCombineParams p) {
  dependent_prologue();
  const int64_t token = blockIdx.x;
  const T* y = static_cast<const T*>(p.y);
  T* out = static_cast<T*>(p.out) + token * p.out_stride;
  const int vecs = p.hidden / kVec;
  for (int v = blockIdx.y * kCombineThreads + threadIdx.x; v < vecs; v += gridDim.y * kCombineThreads) {
    float acc[kVec] = {};
    for (int s = 0; s < p.top_k; ++s) {
      const int64_t at = token * p.top_k + s;
      const int64_t row = p.position != nullptr ? p.position[at] : at;
      const float w = p.weights[at];
      Vec16<T> in;
      in.raw = *reinterpret_cast<const uint4*>(y + row * p.hidden + v * kVec);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float term = __fmul_rn(to_float(in.e[i]), w);
        acc[i] = s == 0 ? term : __fadd_rn(acc[i], term);
      }
    }
    Vec16<T> o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.e[i] = from_float<T>(acc[i]);
    *reinterpret_cast<uint4*>(out + v * kVec) = o.raw;
  }
}

}  // namespace

cudaError_t moe_route(const MoeRouteParams& p, cudaStream_t stream) {
  if (p.tokens < 0 || p.experts < 1 || p.experts > kMoeMaxExperts || p.top_k < 1 || p.top_k > kMoeMaxTopK ||
      p.top_k > p.experts || (p.record != nullptr && p.slots == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (p.tokens == 0) return cudaSuccess;
  const unsigned blocks = unsigned((p.tokens + kRouteWarps - 1) / kRouteWarps);
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    return launch_dependent(moe_route_kernel<T>, dim3(blocks), dim3(kRouteWarps * 32), 0, stream, p);
  });
}

cudaError_t moe_permute(const MoePermuteParams& p, cudaStream_t stream) {
  if (p.slots < 0 || p.top_k < 1 || p.experts < 1 || p.hidden <= 0 || p.hidden % kVec != 0) {
    return cudaErrorInvalidValue;
  }
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    return launch_dependent(moe_permute_kernel<T>, dim3(unsigned(p.experts)), dim3(kPermuteThreads), 0, stream, p);
  });
}

cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream) {
  if (p.tokens < 0 || p.tokens > 0x7fffffff || p.top_k < 1 || p.hidden <= 0 || p.hidden % kVec != 0) {
    return cudaErrorInvalidValue;
  }
  if (p.tokens == 0) return cudaSuccess;
  const int chunks = (p.hidden / kVec + kCombineThreads - 1) / kCombineThreads;
  const dim3 grid(unsigned(p.tokens), unsigned(chunks));
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    return launch_dependent(moe_combine_kernel<T>, grid, dim3(kCombineThreads), 0, stream, p);
  });
}

}  // namespace rollout_kernels
