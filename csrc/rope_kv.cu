// Fused rotate-half RoPE of q/k and KV-cache store: grid (token, slice of the token's heads). The rotation
// rounds like the torch reference (cos/sin cast to T, each product and the sum rounded to T), so both
// backends agree bit for bit.
#include <algorithm>

#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

template <typename T, typename C>
__device__ __forceinline__ void rotate_pair(T* x, int i, int half, const C* cs_row, float& o1, float& o2) {
  const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
  const float c = round_to<T>(to_float(cs_row[i])), s = round_to<T>(to_float(cs_row[i + half]));
  o1 = round_to<T>(round_to<T>(x1 * c) - round_to<T>(x2 * s));
  o2 = round_to<T>(round_to<T>(x2 * c) + round_to<T>(x1 * s));
}

template <typename T, typename C>
__global__ void rope_kv_kernel(RopeKVParams p) {
  const int t = blockIdx.x;
  const int D = p.head_dim, half = D / 2;
  const int64_t slot = p.kv_cache != nullptr ? p.slot_mapping[t] : -1;
  T* cache = static_cast<T*>(p.kv_cache);
  int64_t k_base = 0, v_base = 0;  // cache offsets of head 0 at this token's slot
  if (slot >= 0) {
    const int64_t page = slot / p.page_size, off = slot % p.page_size;
    const int64_t head_elems = static_cast<int64_t>(p.page_size) * D;
    k_base = (page * 2) * p.num_kv_heads * head_elems + off * D;
    v_base = k_base + p.num_kv_heads * head_elems;
  }
  const int64_t head_elems = static_cast<int64_t>(p.page_size) * D;

  if (p.apply_rope) {
    const C* cs_row = static_cast<const C*>(p.cos_sin) + p.positions[t] * D;
    const int heads = p.num_q_heads + p.num_kv_heads;
    for (int idx = threadIdx.x + blockIdx.y * blockDim.x; idx < heads * half; idx += blockDim.x * gridDim.y) {
      const int h = idx / half, i = idx % half;
      const bool is_q = h < p.num_q_heads;
      T* x = is_q ? static_cast<T*>(p.q) + t * p.q_stride_t + h * p.q_stride_h
                  : static_cast<T*>(p.k) + t * p.k_stride_t + (h - p.num_q_heads) * p.k_stride_h;
      float o1, o2;
      rotate_pair<T, C>(x, i, half, cs_row, o1, o2);
      x[i] = from_float<T>(o1);
      x[i + half] = from_float<T>(o2);
      if (!is_q && slot >= 0) {
        T* dst = cache + k_base + (h - p.num_q_heads) * head_elems;
        dst[i] = from_float<T>(o1);
        dst[i + half] = from_float<T>(o2);
      }
    }
  } else if (slot >= 0) {
    const T* k = static_cast<const T*>(p.k);
    for (int idx = threadIdx.x + blockIdx.y * blockDim.x; idx < p.num_kv_heads * D; idx += blockDim.x * gridDim.y) {
      const int h = idx / D, d = idx % D;
      cache[k_base + h * head_elems + d] = k[t * p.k_stride_t + h * p.k_stride_h + d];
    }
  }
  if (slot >= 0) {
    const T* v = static_cast<const T*>(p.v);
    for (int idx = threadIdx.x + blockIdx.y * blockDim.x; idx < p.num_kv_heads * D; idx += blockDim.x * gridDim.y) {
      const int h = idx / D, d = idx % D;
      cache[v_base + h * head_elems + d] = v[t * p.v_stride_t + h * p.v_stride_h + d];
    }
  }
}

template <typename T>
cudaError_t launch_rope_kv(const RopeKVParams& p, cudaStream_t stream) {
  const int threads = 256;
  // One rotated pair per thread: each token's heads spread over several CTAs (one CTA per token serialised
  // ~10 dependent load-store rounds per thread for llama3-8b's 40 heads).
  const int pairs = (p.num_q_heads + p.num_kv_heads) * p.head_dim / 2;
  const dim3 grid(p.num_tokens, std::min((pairs + threads - 1) / threads, 65535));
  if (!p.apply_rope || p.cos_sin_dtype == DType::kFloat32) {
    rope_kv_kernel<T, float><<<grid, threads, 0, stream>>>(p);
  } else if ((p.cos_sin_dtype == DType::kBFloat16) == (p.dtype == DType::kBFloat16)) {
    rope_kv_kernel<T, T><<<grid, threads, 0, stream>>>(p);  // table stored in the activation dtype
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
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
