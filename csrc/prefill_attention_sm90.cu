// Ragged paged prefill attention on Hopper's warpgroup tensor cores (wgmma, sm_90a). Same contract as the
// mma.sync kernel in prefill_attention.cu, which stays the path on every other GPU.
//
// CTA = (128-query tile, query head, sequence): two warpgroups of 64 query rows each. The Q tile and 128-key
// K/V tiles gathered from the pages are copied with cp.async (two stages) into 128-byte-swizzled shared
// memory. S = QK^T is one shared x shared wgmma chain per warpgroup; softmax runs online in float32 on S's
// accumulators, which are then already laid out as the register A operand of O += PV, with V read
// transposed from shared memory. P is rounded to T once (what flash attention does) or, with kParts > 1,
// kept as a sum of parts (split_p) for a float32-exact P·V at kParts times that MMA work.
#include <cfloat>

#include "kernel_utils.cuh"
#include "wgmma.cuh"

namespace rollout_kernels {
namespace {

constexpr int kGroups = 2;  // consumer warpgroups per CTA
constexpr int kThreads90 = kGroups * 128;
constexpr int kTileQ90 = kGroups * 64;
constexpr int kTileKV90 = 128;
constexpr int kStages = 2;  // tiles in flight (three measured no faster on an H200: csrc/NOTES.md)

template <int D>
struct Sm90Shape {
  static constexpr uint32_t kQBytes = kTileQ90 * D * 2;
  static constexpr uint32_t kKVBytes = kTileKV90 * D * 2;  // K or V of one stage
  static constexpr uint32_t kStageBytes = 2 * kKVBytes;
  static constexpr size_t kSmemBytes = kQBytes + kStages * kStageBytes + 1024;  // + slack to align to 1024

  // swizzle atoms need 1024-byte alignment
  static __device__ __forceinline__ unsigned char* aligned(unsigned char* raw) {
    const uint32_t a = smem_addr(raw);
    return raw + (((a + 1023u) & ~1023u) - a);
  }
};

#if ROLLOUT_WGMMA  // the helpers exist where the kernels have bodies
// Where a CTA's query tile sits in its sequence, and which keys it sees.
struct TileSpan {
  int q_beg, q_len, kv_len, page_beg, offset;  // offset: position of query 0 (queries follow a cached prefix)
  int first_pos, num_tiles;

  static __device__ __forceinline__ TileSpan of(const PrefillParams& p, int qt, int b) {
    TileSpan t;
    t.q_beg = p.qo_indptr[b];
    t.q_len = p.qo_indptr[b + 1] - t.q_beg;
    t.page_beg = p.kv.kv_indptr[b];
    const int npages = p.kv.kv_indptr[b + 1] - t.page_beg;
    t.kv_len = npages > 0 ? (npages - 1) * kPageSize + p.kv.kv_last_page_len[b] : 0;
    t.offset = t.kv_len - t.q_len;
    t.first_pos = t.offset + qt * kTileQ90;
    const int block_kv_end = t.offset + min(t.q_len, (qt + 1) * kTileQ90);
    t.num_tiles = (block_kv_end + kTileKV90 - 1) / kTileKV90;
    return t;
  }
};

// cp.async copies of the Q tile and of K/V tiles (gathered from the pages) into swizzled shared memory, by
// kThreads threads, thread `tid` among them.
template <typename T, int D, int kThreads>
struct TileLoader {
  static constexpr int kCopies = kTileKV90 * D / 8 / kThreads;  // 16-byte pieces of K (and of V) per thread
  const PrefillParams& p;
  const TileSpan& span;
  int qt, h, hk, tid;

  __device__ __forceinline__ void load_q(unsigned char* dst) const {
    const T* q = static_cast<const T*>(p.q) + int64_t(span.q_beg) * p.q_stride_t + int64_t(h) * p.q_stride_h;
#pragma unroll
    for (int c = tid; c < kTileQ90 * D / 8; c += kThreads) {
      const int row = c / (D / 8), col = (c % (D / 8)) * 8;
      const bool ok = qt * kTileQ90 + row < span.q_len;
      const T* src = ok ? q + int64_t(qt * kTileQ90 + row) * p.q_stride_t + col : q;
      cp_async16(dst + wgmma::swizzled_offset(row, col, kTileQ90), src, ok);
    }
  }

  __device__ __forceinline__ void load_kv(int n, unsigned char* k_dst, unsigned char* v_dst) const {
    const T* cache = static_cast<const T*>(p.kv.cache);
    const int Hk = p.kv.num_kv_heads;
    const int64_t head_elems = int64_t(kPageSize) * D;
    // Every page number first, all loads in flight at once: fetched one per copy, each waited for before
    // its cp.async (an asm "memory" clobber orders them), they made the copy loop a chain of L2 round trips.
    int pages[kCopies];
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int tok = n * kTileKV90 + (tid + i * kThreads) / (D / 8);
      pages[i] = tok < span.kv_len ? p.kv.kv_indices[span.page_beg + tok / kPageSize] : 0;
    }
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int c = tid + i * kThreads;
      const int row = c / (D / 8), col = (c % (D / 8)) * 8;
      const int tok = n * kTileKV90 + row;
      const bool ok = tok < span.kv_len;  // rows past the end are zero-filled (and masked)
      const T* k_src = cache + (int64_t(pages[i]) * 2 * Hk + hk) * head_elems + (tok % kPageSize) * D + col;
      const uint32_t off = wgmma::swizzled_offset(row, col, kTileKV90);
      cp_async16(k_dst + off, ok ? k_src : cache, ok);
      cp_async16(v_dst + off, ok ? k_src + Hk * head_elems : cache, ok);
    }
  }
};

// One warpgroup's 64 query rows: online softmax state and the O accumulator, fed one K/V tile at a time.
template <typename T, int D, int kParts>
struct RowsAttention {
  int row0, pos0, pos1;  // this thread's two rows (row0 and row0 + 8) and their positions
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[D / 2];

  __device__ __forceinline__ RowsAttention(const TileSpan& span, int qt, int wg) {
    const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
    row0 = qt * kTileQ90 + wg * 64 + warp * 16 + lane / 4;
    pos0 = span.offset + row0;
    pos1 = pos0 + 8;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  }

  // Q (this warpgroup's 64 rows at q_smem) against K/V tile n at k_smem / v_smem.
  __device__ __forceinline__ void attend(const TileSpan& span, float scale_log2, uint32_t q_smem, uint32_t k_smem,
                                         uint32_t v_smem, int n) {
    const int t = threadIdx.x % 4;
    float s[kTileKV90 / 2];
#pragma unroll
    for (int i = 0; i < kTileKV90 / 2; ++i) s[i] = 0.f;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // atom kk / 4 of the row, then 16 columns (32 bytes) inside it
      const uint64_t a = wgmma::descriptor(q_smem + (kk / 4) * kTileQ90 * 128 + (kk % 4) * 32, 16, 1024);
      const uint64_t b = wgmma::descriptor(k_smem + (kk / 4) * kTileKV90 * 128 + (kk % 4) * 32, 16, 1024);
      wgmma::wgmma_ss<T, kTileKV90>(s, a, b, kk > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(s);

    const bool need_mask = (n + 1) * kTileKV90 - 1 > span.first_pos || (n + 1) * kTileKV90 > span.kv_len;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kTileKV90 / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& v = s[4 * j + e];
        const int key = n * kTileKV90 + j * 8 + 2 * t + (e & 1);
        v = (!need_mask || (key <= (e < 2 ? pos0 : pos1) && key < span.kv_len)) ? v * scale_log2 : -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    }
    float corr[2], m_use[2];
    online_softmax_step(m, l, mx, m_use, corr);
#pragma unroll
    for (int i = 0; i < kTileKV90 / 2; ++i) {
      s[i] = fast_exp2(s[i] - m_use[(i >> 1) & 1]);
      l[(i >> 1) & 1] += s[i];
    }
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= corr[(i >> 1) & 1];
    uint32_t pa[kTileKV90 / 16][kParts][4];  // P as A fragments of 16 keys each (the accumulator layout), in parts
#pragma unroll
    for (int kc = 0; kc < kTileKV90 / 16; ++kc) {
#pragma unroll
      for (int r = 0; r < 4; ++r) split_p<T, kParts>(s[8 * kc + 2 * r], s[8 * kc + 2 * r + 1], pa[kc], r);
    }
    wgmma::fence_operands(o);
    wgmma::fence();
#pragma unroll
    for (int kc = 0; kc < kTileKV90 / 16; ++kc) {
      // keys kc*16.. of every 64-column atom of V; the atoms are kTileKV90 * 128 bytes apart
      const uint64_t b = wgmma::descriptor(v_smem + kc * 16 * 128, kTileKV90 * 128, 1024);
#pragma unroll
      for (int q = 0; q < kParts; ++q) wgmma::wgmma_rs_tb<T, D>(o, pa[kc][q], b);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operands(o);
  }

  __device__ __forceinline__ void store(const PrefillParams& p, const TileSpan& span, int h) {
    const int t = threadIdx.x % 4;
    const float inv0 = 1.f / quad_sum(l[0]), inv1 = 1.f / quad_sum(l[1]);
    T* out = static_cast<T*>(p.out) + int64_t(span.q_beg) * p.num_q_heads * D + int64_t(h) * D;
    const int64_t row_stride = int64_t(p.num_q_heads) * D;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int c = j * 8 + 2 * t;
      if (row0 < span.q_len) {
        *reinterpret_cast<uint32_t*>(out + row0 * row_stride + c) = pack2<T>(o[4 * j] * inv0, o[4 * j + 1] * inv0);
      }
      if (row0 + 8 < span.q_len) {
        *reinterpret_cast<uint32_t*>(out + (row0 + 8) * row_stride + c) =
            pack2<T>(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
      }
    }
  }
};


#endif  // ROLLOUT_WGMMA

// Both warpgroups load and compute; a CTA barrier per tile hands the stages over. (A warp-specialised variant,
// a cp.async producer warpgroup feeding the two through mbarriers, measured slower: csrc/NOTES.md.)
template <typename T, int D, int kParts>
__global__ void __launch_bounds__(kThreads90, 1) prefill_sm90_kernel(const PrefillParams p) {
#if ROLLOUT_WGMMA
  using S = Sm90Shape<D>;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = S::aligned(smem_raw);
  const int qt = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;  // late query tiles first
  const TileSpan span = TileSpan::of(p, qt, b);
  if (qt * kTileQ90 >= span.q_len) return;
  const int wg = threadIdx.x / 128, hk = h / (p.num_q_heads / p.kv.num_kv_heads);
  const int wg_first = qt * kTileQ90 + wg * 64;
  const int wg_kv_end = wg_first < span.q_len ? span.offset + min(span.q_len, wg_first + 64) : 0;
  const TileLoader<T, D, kThreads90> loader{p, span, qt, h, hk, int(threadIdx.x)};
  RowsAttention<T, D, kParts> rows(span, qt, wg);
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const uint32_t q_smem = smem_addr(smem);
  auto stage = [&](int n) { return smem + S::kQBytes + (n % kStages) * S::kStageBytes; };

  loader.load_q(smem);  // in the same group as tile 0
#pragma unroll
  for (int n = 0; n < kStages; ++n) {
    if (n < span.num_tiles) loader.load_kv(n, stage(n), stage(n) + S::kKVBytes);
    cp_async_commit();
  }
  for (int n = 0; n < span.num_tiles; ++n) {
    cp_async_wait<kStages - 1>();  // tile n (and Q) have landed; the next ones may still be in flight
    wgmma::fence_proxy_async();
    __syncthreads();
    if (n * kTileKV90 < wg_kv_end) {  // a warpgroup whose rows end before this tile only helps load it
      const uint32_t k_smem = smem_addr(stage(n));
      rows.attend(span, scale_log2, q_smem + wg * 64 * 128, k_smem, k_smem + S::kKVBytes, n);
    }
    __syncthreads();  // every warpgroup is done with stage n % kStages
    if (n + kStages < span.num_tiles) loader.load_kv(n + kStages, stage(n + kStages), stage(n + kStages) + S::kKVBytes);
    cp_async_commit();
  }
  cp_async_wait<0>();
  rows.store(p, span, h);
#endif  // ROLLOUT_WGMMA
}

template <typename T, int D, int kParts>
cudaError_t launch_sm90(const PrefillParams& p, cudaStream_t stream) {
  using S = Sm90Shape<D>;
  auto kernel = prefill_sm90_kernel<T, D, kParts>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(S::kSmemBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid((p.max_q_len + kTileQ90 - 1) / kTileQ90, p.num_q_heads, p.batch);
  kernel<<<grid, kThreads90, S::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t launch_sm90_parts(const PrefillParams& p, cudaStream_t stream) {
  if (p.exact_pv) return launch_sm90<T, D, PParts<T>::kNum>(p, stream);
  return launch_sm90<T, D, 1>(p, stream);
}

}  // namespace

bool prefill_sm90_available() {
  // The kernel body exists only in an sm_90a build; the module is built for the GPU it runs on.
  static const bool available = [] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, prefill_sm90_kernel<__nv_bfloat16, 128, 1>) != cudaSuccess) return false;
    return attr.binaryVersion == 90;
  }();
  return available;
}

cudaError_t prefill_attention_sm90(const PrefillParams& p, cudaStream_t stream) {
  return ROLLOUT_DISPATCH_HALF(p.dtype, T, [&] {
    if (p.head_dim == 128) return launch_sm90_parts<T, 128>(p, stream);
    if (p.head_dim == 64) return launch_sm90_parts<T, 64>(p, stream);
    return cudaErrorInvalidValue;
  });
}

}  // namespace rollout_kernels
