// Ragged paged prefill attention: every prompt (or prompt chunk) of a step in one launch.
//
// CTA = (64-query tile, query head, sequence), 4 warps of 16 query rows each, FlashAttention-2 style:
// Q fragments stay in registers, 64-token K/V tiles gathered from the pages are double-buffered in shared
// memory with cp.async, S = QK^T and O += PV run on mma.sync (m16n8k16, float32 accumulate), softmax is
// online in float32 (P·V exact or flash-style: PrefillParams::exact_pv). On Hopper, prefill_attention_sm90.cu's
// wgmma kernel runs instead unless PrefillImpl::kMmaSync is asked for. Query i of a sequence with q_len queries
// and kv_len keys sits at position kv_len - q_len + i and sees keys 0..that position (causal over a cached
// prefix).
#include <cfloat>

#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileQ = kWarps * 16;
constexpr int kTileKV = 64;

template <int D>
struct PrefillShape {
  static constexpr int kRow = D + 8;  // padded smem row: conflict-free ldmatrix
  static constexpr int kTileElems = kTileKV * kRow;
  static constexpr size_t kSmemBytes = size_t(2) * 2 * kTileElems * 2;  // 2 stages x (K, V)
};

template <typename T, int D, int kParts>
__global__ void __launch_bounds__(kThreads) prefill_kernel(const PrefillParams p) {
  using S = PrefillShape<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  // Late query tiles see the most keys: launch them first.
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int q_beg = p.qo_indptr[b];
  const int q_len = p.qo_indptr[b + 1] - q_beg;
  if (qt * kTileQ >= q_len) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int Hk = p.kv.num_kv_heads, hk = h / (p.num_q_heads / Hk);

  const int page_beg = p.kv.kv_indptr[b];
  const int npages = p.kv.kv_indptr[b + 1] - page_beg;
  const int kv_len = npages > 0 ? (npages - 1) * kPageSize + p.kv.kv_last_page_len[b] : 0;
  const int offset = kv_len - q_len;  // position of query 0
  const int row0 = qt * kTileQ + warp * 16 + g, row1 = row0 + 8;
  const int pos0 = offset + row0, pos1 = offset + row1;
  const int block_kv_end = offset + min(q_len, (qt + 1) * kTileQ);
  const int warp_first = qt * kTileQ + warp * 16;
  const int warp_kv_end = warp_first < q_len ? offset + min(q_len, warp_first + 16) : 0;
  const int num_tiles = (block_kv_end + kTileKV - 1) / kTileKV;

  uint32_t qa[D / 16][4];
  {
    const T* q0 = static_cast<const T*>(p.q) + int64_t(q_beg + row0) * p.q_stride_t + int64_t(h) * p.q_stride_h;
    const T* q1 = q0 + 8 * p.q_stride_t;
    const bool ok0 = row0 < q_len, ok1 = row1 < q_len;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = kk * 16 + 2 * t;
      qa[kk][0] = ok0 ? *reinterpret_cast<const uint32_t*>(q0 + c) : 0u;
      qa[kk][1] = ok1 ? *reinterpret_cast<const uint32_t*>(q1 + c) : 0u;
      qa[kk][2] = ok0 ? *reinterpret_cast<const uint32_t*>(q0 + c + 8) : 0u;
      qa[kk][3] = ok1 ? *reinterpret_cast<const uint32_t*>(q1 + c + 8) : 0u;
    }
  }

  T* tiles = reinterpret_cast<T*>(smem);  // [stage][K|V][kTileKV][kRow]
  const T* cache = static_cast<const T*>(p.kv.cache);
  const int64_t head_elems = int64_t(kPageSize) * D;
  auto load_tile = [&](int n) {
    T* k_dst = tiles + (n & 1) * 2 * S::kTileElems;
    T* v_dst = k_dst + S::kTileElems;
#pragma unroll
    for (int c = threadIdx.x; c < kTileKV * D / 8; c += kThreads) {
      const int row = c / (D / 8), col = (c % (D / 8)) * 8;
      const int tok = n * kTileKV + row;
      const bool ok = tok < kv_len;  // rows past the end are zero-filled (masked below anyway)
      const int64_t page = ok ? p.kv.kv_indices[page_beg + tok / kPageSize] : 0;
      const T* k_src = cache + (page * 2 * Hk + hk) * head_elems + (tok % kPageSize) * D + col;
      cp_async16(k_dst + row * S::kRow + col, ok ? k_src : cache, ok);
      cp_async16(v_dst + row * S::kRow + col, ok ? k_src + Hk * head_elems : cache, ok);
    }
  };

  const float scale_log2 = p.scale * 1.4426950408889634f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  load_tile(0);
  cp_async_commit();
  for (int n = 0; n < num_tiles; ++n) {
    if (n + 1 < num_tiles) load_tile(n + 1);  // its buffer was released by the barrier ending step n-1
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (n * kTileKV < warp_kv_end) {  // warps whose rows end before this tile only help load it
      const T* sk = tiles + (n & 1) * 2 * S::kTileElems;
      const T* sv = sk + S::kTileElems;
      float s[kTileKV / 8][4];
#pragma unroll
      for (int j = 0; j < kTileKV / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < kTileKV / 16; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, sk + (np * 16 + (lane >> 4) * 8 + (lane & 7)) * S::kRow + kk * 16 + ((lane >> 3) & 1) * 8);
          mma_16816<T>(s[2 * np], qa[kk], r[0], r[1]);
          mma_16816<T>(s[2 * np + 1], qa[kk], r[2], r[3]);
        }
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kTileKV / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n * kTileKV + j * 8 + 2 * t + (e & 1);
          const int pos = e < 2 ? pos0 : pos1;
          s[j][e] = (key <= pos && key < kv_len) ? s[j][e] * scale_log2 : -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
        }
      }
      float corr[2], m_use[2];
      online_softmax_step(m, l, mx, m_use, corr);
#pragma unroll
      for (int j = 0; j < kTileKV / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[j][e] = fast_exp2(s[j][e] - m_use[e >> 1]);
          l[e >> 1] += s[j][e];
        }
      }
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        acc[j][0] *= corr[0];
        acc[j][1] *= corr[0];
        acc[j][2] *= corr[1];
        acc[j][3] *= corr[1];
      }
#pragma unroll
      for (int kc = 0; kc < kTileKV / 16; ++kc) {
        uint32_t pa[kParts][4];  // P's A fragment, as parts (split_p)
        split_p<T, kParts>(s[2 * kc][0], s[2 * kc][1], pa, 0);
        split_p<T, kParts>(s[2 * kc][2], s[2 * kc][3], pa, 1);
        split_p<T, kParts>(s[2 * kc + 1][0], s[2 * kc + 1][1], pa, 2);
        split_p<T, kParts>(s[2 * kc + 1][2], s[2 * kc + 1][3], pa, 3);
#pragma unroll
        for (int dn = 0; dn < D / 16; ++dn) {
          uint32_t r[4];
          ldmatrix_x4_trans(r, sv + (kc * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * S::kRow + dn * 16 +
                                   (lane >> 4) * 8);
#pragma unroll
          for (int q = 0; q < kParts; ++q) {
            mma_16816<T>(acc[2 * dn], pa[q], r[0], r[1]);
            mma_16816<T>(acc[2 * dn + 1], pa[q], r[2], r[3]);
          }
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  const float inv0 = 1.f / quad_sum(l[0]), inv1 = 1.f / quad_sum(l[1]);
  T* out = static_cast<T*>(p.out);
  const int64_t row_stride = int64_t(p.num_q_heads) * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int c = j * 8 + 2 * t;
    if (row0 < q_len) {
      *reinterpret_cast<uint32_t*>(out + (q_beg + row0) * row_stride + int64_t(h) * D + c) =
          pack2<T>(acc[j][0] * inv0, acc[j][1] * inv0);
    }
    if (row1 < q_len) {
      *reinterpret_cast<uint32_t*>(out + (q_beg + row1) * row_stride + int64_t(h) * D + c) =
          pack2<T>(acc[j][2] * inv1, acc[j][3] * inv1);
    }
  }
}

template <typename T, int D, int kParts>
cudaError_t launch_prefill(const PrefillParams& p, cudaStream_t stream) {
  using S = PrefillShape<D>;
  auto kernel = prefill_kernel<T, D, kParts>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kSmemBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid((p.max_q_len + kTileQ - 1) / kTileQ, p.num_q_heads, p.batch);
  kernel<<<grid, kThreads, S::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t prefill_attention(const PrefillParams& p, cudaStream_t stream) {
  const int Hk = p.kv.num_kv_heads;
  if (Hk <= 0 || p.num_q_heads % Hk != 0 || p.max_q_len < 0) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.max_q_len == 0) return cudaSuccess;
  if (p.head_dim != 128 && p.head_dim != 64) return cudaErrorInvalidValue;
  // The wgmma kernel copies q rows in 16-byte pieces.
  const bool q_vectors = reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && p.q_stride_t % 8 == 0 && p.q_stride_h % 8 == 0;
  if (p.impl == PrefillImpl::kAuto && q_vectors && prefill_sm90_available()) return prefill_attention_sm90(p, stream);
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    constexpr int kExact = PParts<T>::kNum;
    if (p.head_dim == 128) {
      return p.exact_pv ? launch_prefill<T, 128, kExact>(p, stream) : launch_prefill<T, 128, 1>(p, stream);
    }
    return p.exact_pv ? launch_prefill<T, 64, kExact>(p, stream) : launch_prefill<T, 64, 1>(p, stream);
  });
}

}  // namespace rollout_kernels
