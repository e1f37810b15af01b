// Paged decode attention (one query token per sequence), GQA-packed and split-KV (flash-decoding).
//
// CTA = (split, kv head, sequence), 4 warps. The G query heads that share a KV head are the rows of one
// 16-row mma.sync tile, so each K/V page is read from HBM once for all of them. Each warp streams its own
// pages (page w, w+4, ...) of the split through a private cp.async ring in shared memory, keeps an
// online softmax in float32, and the 4 warps merge through shared memory at the end. With one split
// the CTA writes the output; otherwise it writes a normalised partial + log-sum-exp that
// decode_reduce_kernel combines. In per-warp mode (many short sequences) each warp owns one
// (sequence, kv head) whole and writes its rows itself.
#include <cfloat>

#include "kernel_utils.cuh"

namespace rollout_kernels {
namespace {

// 4 warps x 3 pages in flight each. 8 warps per CTA measured the same on every W4 case on an H200 (csrc/NOTES.md):
// twice the warps per SM doubled each warp's cycles per instruction.
template <int D>
struct DecodeShape {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStages = 3;                 // pages in a warp's ring
  static constexpr int kRow = D + 8;                // padded smem row: conflict-free ldmatrix
  static constexpr int kPageElems = kPageSize * kRow;
  static constexpr int kStageElems = 2 * kPageElems;  // K page then V page
  static constexpr size_t kRingBytes = size_t(kWarps) * kStages * kStageElems * 2;
  static constexpr size_t kMergeBytes = size_t(kWarps) * 16 * (D + 2) * 4;
  static constexpr size_t kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
};

__device__ __forceinline__ uint32_t load_pair(const void* p) { return *static_cast<const uint32_t*>(p); }

template <typename T, int D>
__global__ void __launch_bounds__(DecodeShape<D>::kThreads, 2) decode_kernel(const DecodeParams p) {
  using S = DecodeShape<D>;
  constexpr int kWarps = S::kWarps;
  extern __shared__ __align__(16) unsigned char smem[];
  dependent_prologue();  // q comes from the kernel before; the next one (the reduce) may start its launch now
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;
  const int Hk = p.kv.num_kv_heads, G = p.num_q_heads / Hk;
  // Per-warp mode: warp w of CTA c owns (sequence, kv head) number 4c + w whole, and needs no merge.
  const bool per_warp = p.warp_per_head;
  const int unit = blockIdx.x * kWarps + warp;
  const int split = per_warp ? 0 : blockIdx.x;
  const int hk = per_warp ? unit % Hk : blockIdx.y;
  const int b = per_warp ? unit / Hk : blockIdx.z;
  if (b >= p.batch) return;  // per-warp mode's last CTA; no block barrier follows in that mode
  const int w_first = per_warp ? 0 : warp, w_step = per_warp ? 1 : kWarps;  // the warp's pages: first, stride

  const int page_beg = p.kv.kv_indptr[b];
  const int npages = p.kv.kv_indptr[b + 1] - page_beg;
  const int last_len = p.kv.kv_last_page_len[b];
  // Each sequence divides its own pages over the splits, so a fixed split count (CUDA graphs) adapts.
  const int per_split = (npages + p.num_splits - 1) / p.num_splits;
  const int p0 = split * per_split;
  const int p1 = min(p0 + per_split, npages);
  const int mine = p1 - p0 > w_first ? (p1 - p0 - w_first + w_step - 1) / w_step : 0;

  // The warp's page numbers, 32 at a time in a register per lane (read by shuffle), with the next 32
  // already in flight: a page-table load per page would sit on the warp's critical path.
  const int* my_indices = p.kv.kv_indices + page_beg + p0 + w_first;  // the warp's i-th page: [i * w_step]
  auto fetch_indices = [&](int chunk) {
    const int i = chunk * 32 + lane;
    return i < mine ? my_indices[i * w_step] : 0;
  };
  int idx_cur = fetch_indices(0), idx_next = fetch_indices(1);

  // Query fragments (A operand): rows = the group's query heads, zero past G.
  uint32_t qa[D / 16][4];
  {
    const T* qb = static_cast<const T*>(p.q) + b * p.q_stride_t + int64_t(hk) * G * p.q_stride_h;
    const T* q0 = qb + int64_t(g) * p.q_stride_h;
    const T* q1 = qb + int64_t(g + 8) * p.q_stride_h;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const int c = kk * 16 + 2 * t;
      qa[kk][0] = g < G ? load_pair(q0 + c) : 0u;
      qa[kk][1] = g + 8 < G ? load_pair(q1 + c) : 0u;
      qa[kk][2] = g < G ? load_pair(q0 + c + 8) : 0u;
      qa[kk][3] = g + 8 < G ? load_pair(q1 + c + 8) : 0u;
    }
  }

  T* ring = reinterpret_cast<T*>(smem) + warp * S::kStages * S::kStageElems;
  const T* cache = static_cast<const T*>(p.kv.cache);
  const int64_t head_elems = int64_t(kPageSize) * D;

  auto load_page = [&](int i) {  // the warp's i-th page into ring slot i % kStages; i rises by one per call
    if (i > 0 && i % 32 == 0) {
      idx_cur = idx_next;
      idx_next = fetch_indices(i / 32 + 1);
    }
    const int64_t page = __shfl_sync(0xffffffffu, idx_cur, i % 32);
    const int lp = p0 + w_first + i * w_step;
    const int valid = lp == npages - 1 ? last_len : kPageSize;
    const T* k_src = cache + (page * 2 * Hk + hk) * head_elems;
    const T* v_src = k_src + Hk * head_elems;
    T* k_dst = ring + (i % S::kStages) * S::kStageElems;
    T* v_dst = k_dst + S::kPageElems;
#pragma unroll
    for (int c = lane; c < kPageSize * D / 8; c += 32) {
      const int row = c / (D / 8), col = (c % (D / 8)) * 8;
      // Stale rows of the last page are zero-filled (0 * NaN must not happen); their source address is
      // still inside the page, so it needs no select.
      const bool ok = row < valid;
      cp_async16(k_dst + row * S::kRow + col, k_src + row * D + col, ok);
      cp_async16(v_dst + row * S::kRow + col, v_src + row * D + col, ok);
    }
  };

  const float scale_log2 = p.scale * 1.4426950408889634f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

#pragma unroll
  for (int s = 0; s < S::kStages - 1; ++s) {
    if (s < mine) load_page(s);
    cp_async_commit();
  }
  for (int i = 0; i < mine; ++i) {
    if (i + S::kStages - 1 < mine) load_page(i + S::kStages - 1);
    cp_async_commit();
    cp_async_wait<S::kStages - 1>();
    __syncwarp();
    const T* sk = ring + (i % S::kStages) * S::kStageElems;
    const T* sv = sk + S::kPageElems;
    const int lp = p0 + w_first + i * w_step;
    const int valid = lp == npages - 1 ? last_len : kPageSize;

    // scores[16 heads x 16 tokens] = Q K^T, as two 16x8 accumulator tiles
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t r[4];
      ldmatrix_x4(r, sk + ((lane >> 4) * 8 + (lane & 7)) * S::kRow + kk * 16 + ((lane >> 3) & 1) * 8);
      mma_16816<T>(s[0], qa[kk], r[0], r[1]);
      mma_16816<T>(s[1], qa[kk], r[2], r[3]);
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] *= scale_log2;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
      }
    }
    if (valid < kPageSize) {  // the sequence's last page (warp-uniform): mask its stale tokens
      mx[0] = mx[1] = -INFINITY;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (n * 8 + 2 * t + (e & 1) >= valid) s[n][e] = -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
        }
      }
    }
    float corr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m[h], quad_max(mx[h]));  // finite: token 0 of every page is valid
      corr[h] = fast_exp2(m[h] - m_new);
      m[h] = m_new;
      l[h] *= corr[h];
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = fast_exp2(s[n][e] - m[e >> 1]);
        l[e >> 1] += s[n][e];
      }
    }
    // Once the running max settles, corr is exactly 1 for the whole warp and rescaling would be a no-op.
    if (!__all_sync(0xffffffffu, corr[0] == 1.f && corr[1] == 1.f)) {
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= corr[0];
        acc[n][1] *= corr[0];
        acc[n][2] *= corr[1];
        acc[n][3] *= corr[1];
      }
    }
    // The two score tiles are exactly the A fragment of P for the k=16 (token) dimension.
    constexpr int kParts = PParts<T>::kNum;
    uint32_t pa[kParts][4];
    split_p<T>(s[0][0], s[0][1], pa, 0);
    split_p<T>(s[0][2], s[0][3], pa, 1);
    split_p<T>(s[1][0], s[1][1], pa, 2);
    split_p<T>(s[1][2], s[1][3], pa, 3);
#pragma unroll
    for (int dn = 0; dn < D / 16; ++dn) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, sv + (((lane >> 3) & 1) * 8 + (lane & 7)) * S::kRow + dn * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int q = 0; q < kParts; ++q) {
        mma_16816<T>(acc[2 * dn], pa[q], r[0], r[1]);
        mma_16816<T>(acc[2 * dn + 1], pa[q], r[2], r[3]);
      }
    }
    __syncwarp();  // the slot is refilled next iteration
  }
  cp_async_wait<0>();
  l[0] = quad_sum(l[0]);
  l[1] = quad_sum(l[1]);
  if (per_warp) {  // the warp saw every page: normalise and write its rows (the merge's result for one warp)
    T* out = static_cast<T*>(p.out) + (int64_t(b) * p.num_q_heads + hk * G) * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const int c = n * 8 + 2 * t;
      if (g < G) *reinterpret_cast<uint32_t*>(out + g * D + c) = pack2<T>(acc[n][0] / l[0], acc[n][1] / l[0]);
      if (g + 8 < G)
        *reinterpret_cast<uint32_t*>(out + (g + 8) * D + c) = pack2<T>(acc[n][2] / l[1], acc[n][3] / l[1]);
    }
    return;
  }
  __syncthreads();  // every warp is done with its ring: reuse the memory for the merge

  float* m_acc = reinterpret_cast<float*>(smem);  // [warps][16][D]
  float* m_max = m_acc + kWarps * 16 * D;          // [warps][16]
  float* m_sum = m_max + kWarps * 16;              // [warps][16]
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int c = n * 8 + 2 * t;
    m_acc[(warp * 16 + g) * D + c] = acc[n][0];
    m_acc[(warp * 16 + g) * D + c + 1] = acc[n][1];
    m_acc[(warp * 16 + g + 8) * D + c] = acc[n][2];
    m_acc[(warp * 16 + g + 8) * D + c + 1] = acc[n][3];
  }
  if (t == 0) {
    m_max[warp * 16 + g] = m[0];
    m_max[warp * 16 + g + 8] = m[1];
    m_sum[warp * 16 + g] = l[0];
    m_sum[warp * 16 + g + 8] = l[1];
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < G * D; idx += S::kThreads) {
    const int r = idx / D, d = idx % D;
    float mw = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mw = fmaxf(mw, m_max[w * 16 + r]);
    float o = 0.f, lse = -INFINITY;
    if (mw != -INFINITY) {  // -inf only for a split with no pages
      float num = 0.f, den = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = fast_exp2(m_max[w * 16 + r] - mw);
        num += f * m_acc[(w * 16 + r) * D + d];
        den += f * m_sum[w * 16 + r];
      }
      o = num / den;
      lse = mw + __log2f(den);
    }
    const int hq = hk * G + r;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[(int64_t(b) * p.num_q_heads + hq) * D + d] = from_float<T>(o);
    } else {
      const int64_t row = (int64_t(split) * p.batch + b) * p.num_q_heads + hq;
      p.partial_out[row * D + d] = o;
      if (d == 0) p.partial_lse[row] = lse;
    }
  }
}

// out[b, h] = sum over splits of partial_out weighted by exp2(lse_s - max lse).
template <typename T, int D>
__global__ void __launch_bounds__(D) decode_reduce_kernel(const DecodeParams p) {
  const int64_t bh = blockIdx.x, rows = int64_t(p.batch) * p.num_q_heads;
  const int d = threadIdx.x;
  dependent_prologue();  // launched early (programmatic dependent launch): the partials come first
  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, p.partial_lse[s * rows + bh]);
  float num = 0.f, den = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float f = fast_exp2(p.partial_lse[s * rows + bh] - mx);
      num += f * p.partial_out[(s * rows + bh) * D + d];
      den += f;
    }
  }
  static_cast<T*>(p.out)[bh * D + d] = from_float<T>(den > 0.f ? num / den : 0.f);
}

template <typename T, int D>
cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  using S = DecodeShape<D>;
  auto kernel = decode_kernel<T, D>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kSmemBytes));
  if (err != cudaSuccess) return err;
  const int units = p.batch * p.kv.num_kv_heads;
  const dim3 grid = p.warp_per_head ? dim3(unsigned((units + S::kWarps - 1) / S::kWarps))
                                    : dim3(p.num_splits, p.kv.num_kv_heads, p.batch);
  err = launch_dependent(kernel, grid, dim3(S::kThreads), S::kSmemBytes, stream, p);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  // The reduce launches while the split CTAs still run and waits for them on the device: the launch
  // gap between the two kernels (~1-2 µs, most of a batch-1 layer's attention) overlaps.
  return launch_dependent(decode_reduce_kernel<T, D>, dim3(unsigned(p.batch * p.num_q_heads)), dim3(D), 0, stream, p);
}

}  // namespace

int decode_num_splits(int batch, int num_kv_heads, int max_pages, int num_sms) {
  // Tuned on an H200 (split sweeps: csrc/NOTES.md): the largest power of two that keeps
  // the grid within ~1 CTA per SM, while each split keeps >= 8 pages (1k context) to >= 16 pages (4k+) so
  // the warps' merge and the reduce kernel stay amortised; at most 32.
  const int ctas = batch * num_kv_heads;
  if (ctas >= num_sms || max_pages < 16) return 1;
  const int min_pages = min(16, max(8, max_pages / 16));
  int splits = 1;
  while (splits < 32 && ctas * splits * 2 <= num_sms && (splits * 2) * min_pages <= max_pages) splits *= 2;
  return splits;
}

bool decode_warp_per_head(int batch, int num_kv_heads, int max_pages, int num_sms) {
  // Short contexts at large batch (a rollout's decode): four warps splitting a dozen pages spend most of
  // their time filling their rings and merging; one warp per (sequence, kv head) streams them back to back.
  // H200 sweep (csrc/NOTES.md): it wins from ~4 units per SM (14/2 heads at batch 256, 32/8 at
  // batch 128 and 256) and loses at 2 (14/2 at batch 128).
  return max_pages <= 32 && batch * num_kv_heads >= 3 * num_sms;
}

cudaError_t decode_attention(const DecodeParams& p, cudaStream_t stream) {
  const int Hk = p.kv.num_kv_heads;
  if (Hk <= 0 || p.num_q_heads % Hk != 0 || p.num_q_heads / Hk > kMaxGroupSize || p.num_splits < 1 ||
      (p.warp_per_head && p.num_splits != 1) ||
      (p.num_splits > 1 && (p.partial_out == nullptr || p.partial_lse == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.head_dim == 128) return launch_decode<T, 128>(p, stream);
    if (p.head_dim == 64) return launch_decode<T, 64>(p, stream);
    return cudaErrorInvalidValue;
  });
}

}  // namespace rollout_kernels
