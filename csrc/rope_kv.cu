// Fused rotate-half RoPE of q/k and KV-cache store: grid (token, slice of the token's heads). The rotation
// rounds like the torch reference (cos/sin cast to T, each product and the sum rounded to T), so both
// backends agree bit for bit. Each thread handles V consecutive pairs: V = 8 (16-byte loads and stores) when
// the pointers, strides and head_dim allow it, else 1.
#include <algorithm>

#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T e[V];
};

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load(const T* p) { return *reinterpret_cast<const Pack<T, V>*>(p); }
template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Pack<T, V>& v) { *reinterpret_cast<Pack<T, V>*>(p) = v; }

// Rotate the V pairs (x[i + j], x[i + half + j]) in place; the rotated k halves go to the cache too.
template <typename T, typename C, int V>
__device__ __forceinline__ void rotate(T* x, T* cache_dst, int i, int half, const C* cs_row) {
  const Pack<T, V> a = load<T, V>(x + i), b = load<T, V>(x + i + half);
  Pack<T, V> o1, o2;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float x1 = to_float(a.e[j]), x2 = to_float(b.e[j]);
    const float c = round_to<T>(to_float(cs_row[i + j])), s = round_to<T>(to_float(cs_row[i + j + half]));
    o1.e[j] = from_float<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
    o2.e[j] = from_float<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
  }
  store<T, V>(x + i, o1);
  store<T, V>(x + i + half, o2);
  if (cache_dst != nullptr) {
    store<T, V>(cache_dst + i, o1);
    store<T, V>(cache_dst + i + half, o2);
  }
}

// Copy heads [T, H, D] of token t into the cache at base (head h at base + h * head_elems), V at a time.
template <typename T, int V>
__device__ __forceinline__ void copy_heads(T* cache, int64_t base, int64_t head_elems, const T* src, int64_t stride_h,
                                           int heads, int D) {
  const int chunks = D / V;
  for (int idx = threadIdx.x + blockIdx.y * blockDim.x; idx < heads * chunks; idx += blockDim.x * gridDim.y) {
    const int h = idx / chunks, d = (idx % chunks) * V;
    store<T, V>(cache + base + h * head_elems + d, load<T, V>(src + h * stride_h + d));
  }
}

template <typename T, typename C, int V>
__global__ void rope_kv_kernel(RopeKVParams p) {
  dependent_prologue();
  const int t = blockIdx.x;
  const int D = p.head_dim, half = D / 2;
  const int64_t slot = p.kv_cache != nullptr ? p.slot_mapping[t] : -1;
  T* cache = static_cast<T*>(p.kv_cache);
  const int64_t head_elems = static_cast<int64_t>(p.page_size) * D;
  int64_t k_base = 0, v_base = 0;  // cache offsets of head 0 at this token's slot
  if (slot >= 0) {
    const int64_t page = slot / p.page_size, off = slot % p.page_size;
    k_base = (page * 2) * p.num_kv_heads * head_elems + off * D;
    v_base = k_base + p.num_kv_heads * head_elems;
  }
  T* k = static_cast<T*>(p.k) + t * p.k_stride_t;

  if (p.apply_rope) {
    const C* cs_row = static_cast<const C*>(p.cos_sin) + p.positions[t] * D;
    const int heads = p.num_q_heads + p.num_kv_heads, chunks = half / V;
    for (int idx = threadIdx.x + blockIdx.y * blockDim.x; idx < heads * chunks; idx += blockDim.x * gridDim.y) {
      const int h = idx / chunks, i = (idx % chunks) * V;
      if (h < p.num_q_heads) {
        rotate<T, C, V>(static_cast<T*>(p.q) + t * p.q_stride_t + h * p.q_stride_h, nullptr, i, half, cs_row);
      } else {
        const int hk = h - p.num_q_heads;
        rotate<T, C, V>(k + hk * p.k_stride_h, slot >= 0 ? cache + k_base + hk * head_elems : nullptr, i, half,
                        cs_row);
      }
    }
  } else if (slot >= 0) {
    copy_heads<T, V>(cache, k_base, head_elems, k, p.k_stride_h, p.num_kv_heads, D);
  }
  if (slot >= 0) {
    const T* v = static_cast<const T*>(p.v) + t * p.v_stride_t;
    copy_heads<T, V>(cache, v_base, head_elems, v, p.v_stride_h, p.num_kv_heads, D);
  }
}

bool aligned(const void* ptr, int64_t stride_t, int64_t stride_h) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && stride_t % kVec == 0 && stride_h % kVec == 0;
}

// 16-byte vectors need every row start 16-byte aligned and both halves of a head a whole number of vectors.
bool vectorisable(const RopeKVParams& p) {
  return p.head_dim % (2 * kVec) == 0 && aligned(p.k, p.k_stride_t, p.k_stride_h) &&
         (!p.apply_rope || aligned(p.q, p.q_stride_t, p.q_stride_h)) &&
         (p.kv_cache == nullptr || (aligned(p.v, p.v_stride_t, p.v_stride_h) && aligned(p.kv_cache, 0, 0)));
}

template <typename T, typename C>
cudaError_t launch(const RopeKVParams& p, cudaStream_t stream) {
  const int threads = 256;
  const int V = vectorisable(p) ? kVec : 1;
  // One work item (V pairs) per thread: each token's heads spread over several CTAs (one CTA per token
  // serialised ~10 dependent load-store rounds per thread for llama3-8b's 40 heads). The q+k pairs are at
  // least as many as the k and v elements the cache copies handle.
  const int items = (p.num_q_heads + p.num_kv_heads) * p.head_dim / 2 / V;
  const dim3 grid(p.num_tokens, std::min((items + threads - 1) / threads, 65535));
  if (V == kVec) return launch_dependent(rope_kv_kernel<T, C, kVec>, grid, dim3(threads), 0, stream, p);
  return launch_dependent(rope_kv_kernel<T, C, 1>, grid, dim3(threads), 0, stream, p);
}

template <typename T>
cudaError_t launch_rope_kv(const RopeKVParams& p, cudaStream_t stream) {
  if (!p.apply_rope || p.cos_sin_dtype == DType::kFloat32) return launch<T, float>(p, stream);
  if ((p.cos_sin_dtype == DType::kBFloat16) == (p.dtype == DType::kBFloat16)) {
    return launch<T, T>(p, stream);  // table stored in the activation dtype
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t rope_kv(const RopeKVParams& p, cudaStream_t stream) {
  if (p.head_dim % 2 != 0 || (p.apply_rope && (p.q == nullptr || p.positions == nullptr)) ||
      (p.kv_cache != nullptr && (p.v == nullptr || p.slot_mapping == nullptr)) || p.k == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tokens == 0) return cudaSuccess;
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] { return launch_rope_kv<T>(p, stream); });
}

}  // namespace rollout_kernels
