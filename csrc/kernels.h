// Launchers for the rollout_service CUDA kernels. Torch-free on purpose: raw pointers, sizes, strides
// and the stream come in, a cudaError_t goes out, so every .cu compiles with plain nvcc (CI has no GPU).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace rollout_kernels {

enum class DType : int { kBFloat16 = 0, kFloat16 = 1, kFloat32 = 2 };

// y = rms_norm(x) * weight over rows of `hidden` elements. With `residual` set, first
// residual = x + residual (in place) and the norm is taken of that sum. hidden % 8 == 0,
// 16-byte aligned rows (strides in elements).
cudaError_t rms_norm(void* out, const void* x, void* residual, const void* weight, DType dtype, int64_t rows,
                     int64_t hidden, int64_t out_stride, int64_t x_stride, int64_t residual_stride, float eps,
                     cudaStream_t stream);

// out = silu(x[:, :inter]) * x[:, inter:] over rows (the fused gate_up projection). inter % 8 == 0,
// 16-byte aligned rows (strides in elements).
cudaError_t silu_and_mul(void* out, const void* x, DType dtype, int64_t rows, int64_t inter, int64_t out_stride,
                         int64_t x_stride, cudaStream_t stream);

// FP8 activations (fp8.cuh): q [rows, cols] e4m3 bytes, contiguous; scale [rows] float32, per row
// amax / 448 (ops/fp8.py's quantize_rows). rms_norm_fp8 is rms_norm (residual add included when residual is
// given) with its output quantized instead of stored; silu_and_mul_fp8 is silu_and_mul's, q [rows, inter].
int fp8_row_threads(int64_t cols);  // threads of a one-CTA-per-row kernel over cols values
cudaError_t fp8_quantize(void* q, float* scale, const void* x, DType dtype, int64_t rows, int64_t cols,
                         int64_t x_stride, cudaStream_t stream);
cudaError_t rms_norm_fp8(void* q, float* q_scale, const void* x, void* residual, const void* weight, DType dtype,
                         int64_t rows, int64_t hidden, int64_t x_stride, int64_t residual_stride, float eps,
                         cudaStream_t stream);
cudaError_t silu_and_mul_fp8(void* q, float* q_scale, const void* x, DType dtype, int64_t rows, int64_t inter,
                             int64_t x_stride, cudaStream_t stream);

// Rotate-half RoPE of q and k in place and/or store k and v in the paged cache at slot_mapping.
struct RopeKVParams {
  void* q = nullptr;  // [T, Hq, D], may be null when apply_rope is false
  int64_t q_stride_t = 0, q_stride_h = 0;
  void* k = nullptr;  // [T, Hk, D]
  int64_t k_stride_t = 0, k_stride_h = 0;
  const void* v = nullptr;  // [T, Hk, D], needed only with a cache
  int64_t v_stride_t = 0, v_stride_h = 0;
  const int64_t* positions = nullptr;  // [T]
  const void* cos_sin = nullptr;       // [max_pos, D]: cos in the first half, sin in the second
  DType cos_sin_dtype = DType::kFloat32;
  void* kv_cache = nullptr;                // [num_pages, 2, Hk, page_size, D], contiguous; null = no write
  const int64_t* slot_mapping = nullptr;   // [T]; a negative slot is skipped
  bool apply_rope = true;
  DType dtype = DType::kBFloat16;
  int num_tokens = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0;
};
cudaError_t rope_kv(const RopeKVParams& p, cudaStream_t stream);

// The paged cache and its CSR page table, shared by both attention kernels.
struct PagedKV {
  const void* cache = nullptr;  // [num_pages, 2, Hk, 16, D], contiguous
  const int* kv_indptr = nullptr;         // [B+1]
  const int* kv_indices = nullptr;        // [nnz]
  const int* kv_last_page_len = nullptr;  // [B]
  int num_kv_heads = 0;
};

struct DecodeParams {
  PagedKV kv;
  const void* q = nullptr;  // [B, Hq, D]
  int64_t q_stride_t = 0, q_stride_h = 0;
  void* out = nullptr;  // [B, Hq, D], contiguous
  float* partial_out = nullptr;  // [num_splits, B, Hq, D] (num_splits > 1 only)
  float* partial_lse = nullptr;  // [num_splits, B, Hq]
  int batch = 0, num_q_heads = 0, head_dim = 0, num_splits = 1;
  bool warp_per_head = false;  // one warp per (sequence, kv head) instead of a CTA; needs num_splits == 1
  float scale = 1.f;
  DType dtype = DType::kBFloat16;
};
// Whether the decode kernel should run one warp per (sequence, kv head): short contexts, many of them.
bool decode_warp_per_head(int batch, int num_kv_heads, int max_pages, int num_sms);
// Split count for flash-decoding: about one CTA per SM, at least 8 pages per split.
int decode_num_splits(int batch, int num_kv_heads, int max_pages, int num_sms);
cudaError_t decode_attention(const DecodeParams& p, cudaStream_t stream);

// Which prefill kernel: the best this GPU has (wgmma on Hopper, else mma.sync), or mma.sync forced.
enum class PrefillImpl : int { kAuto = 0, kMmaSync = 1 };

struct PrefillParams {
  PagedKV kv;
  const void* q = nullptr;  // [T, Hq, D]
  int64_t q_stride_t = 0, q_stride_h = 0;
  void* out = nullptr;  // [T, Hq, D], contiguous
  const int* qo_indptr = nullptr;  // [B+1]
  int batch = 0, num_q_heads = 0, head_dim = 0, max_q_len = 0;
  float scale = 1.f;
  DType dtype = DType::kBFloat16;
  // P·V with P kept to float32 precision (split_p: three bf16 / two fp16 parts, 2-3x the P·V work) instead
  // of rounded once to the dtype as flash attention does.
  bool exact_pv = false;
  PrefillImpl impl = PrefillImpl::kAuto;
};
cudaError_t prefill_attention(const PrefillParams& p, cudaStream_t stream);
// The Hopper (wgmma) kernel: whether this build has it (sm_90a), and its launcher.
bool prefill_sm90_available();
cudaError_t prefill_attention_sm90(const PrefillParams& p, cudaStream_t stream);

// Linear layers of a batch-1 decode step: out[n] = x . weight[n] (+ bias[n]), float32 sums rounded once.
// gated: weight is the fused [2N, k] gate_up projection and out[n] = silu(y[n]) * y[N + n], each step
// rounded to the dtype as the torch reference does.
//
// Several rows (mixture-of-experts slots at small batches): row r reads x row r / x_div and writes out row r,
// with the weight of expert expert_ids[r] (weight + expert_ids[r] * expert_stride) when expert_ids is set.
struct GemvParams {
  const void* x = nullptr;       // [k] per row, 16-byte aligned
  const void* weight = nullptr;  // [n, k] ([2n, k] when gated), contiguous, 16-byte aligned
  const void* bias = nullptr;    // [n] ([2n] when gated) or null
  void* out = nullptr;           // [n] per row: float32 when out_float, else the dtype
  int n = 0, k = 0;
  int split = 1;  // warps per output column (gemv_split)
  bool gated = false, out_float = false;
  DType dtype = DType::kBFloat16;
  int rows = 1, x_div = 1;       // rows <= 65535 (a grid dimension)
  int64_t x_stride = 0, out_stride = 0;
  const int* expert_ids = nullptr;  // [rows] or null (every row the one weight)
  int64_t expert_stride = 0;        // elements from one expert's weight to the next
};
// columns: n times the rows.
int gemv_split(int64_t columns, int k, int num_sms);
cudaError_t gemv(const GemvParams& p, cudaStream_t stream);

// One row's FP8 product (ops/fp8.py): out [n] (the dtype) = (sum_k x[k] * weight[n, k]) * x_scale[0] * w_scale[n]
// (+ bias[n]), x [k] and weight [n, k] e4m3 (k % 16 == 0, 16-byte aligned), float32 sums.
struct GemvFp8Params {
  const void* x = nullptr;
  const float* x_scale = nullptr;
  const void* weight = nullptr;
  const float* w_scale = nullptr;
  const void* bias = nullptr;  // [n] in the dtype, or null
  void* out = nullptr;
  int n = 0, k = 0;
  int split = 1;  // warps per group of output columns (gemv_fp8_split)
  DType dtype = DType::kBFloat16;
};
int gemv_fp8_split(int n, int k, int num_sms);
cudaError_t gemv_fp8(const GemvFp8Params& p, cudaStream_t stream);

// Mixture-of-experts around the grouped products (csrc/moe.cu; the semantics: ops/moe.py).
constexpr int kMoeMaxExperts = 512;
constexpr int kMoeMaxTopK = 16;

// ids / weights [tokens, top_k] of router logits [tokens, experts] (the model dtype): float32 softmax, top-k,
// optionally renormalised. With record set, ids also go to record[slots[t] * record_stride + s] (uint8, or
// int16 holding uint16 bits when record_wide) for every token whose slot is >= 0.
struct MoeRouteParams {
  const void* logits = nullptr;
  int64_t logits_stride = 0;
  int* ids = nullptr;
  float* weights = nullptr;
  void* record = nullptr;
  const int64_t* slots = nullptr;
  int64_t record_stride = 0;
  bool record_wide = false, renormalize = false;
  int tokens = 0, experts = 0, top_k = 0;
  DType dtype = DType::kBFloat16;
};
cudaError_t moe_route(const MoeRouteParams& p, cudaStream_t stream);

// The (token, slot) rows in expert order, stably: offsets[e] = rows routed to experts 0..e (cumulative ends, as
// torch._grouped_mm takes them), position[t * top_k + s] = the grouped row of (t, s), and grouped[position] =
// x[t]. ids [slots = tokens * top_k] int32 in [0, experts).
struct MoePermuteParams {
  const int* ids = nullptr;
  const void* x = nullptr;  // [tokens, hidden], rows x_stride apart, 16-byte aligned
  int64_t x_stride = 0;
  void* grouped = nullptr;  // [slots, hidden], contiguous
  int* offsets = nullptr;   // [experts]
  int* position = nullptr;  // [slots]
  int slots = 0, top_k = 0, experts = 0, hidden = 0;
  DType dtype = DType::kBFloat16;
};
cudaError_t moe_permute(const MoePermuteParams& p, cudaStream_t stream);

// out[t] = sum over s of weights[t, s] * y[position[t * top_k + s]] (y row t * top_k + s when position is null),
// in float32 in slot order, rounded once.
struct MoeCombineParams {
  const void* y = nullptr;  // [rows, hidden], contiguous
  const int* position = nullptr;
  const float* weights = nullptr;  // [tokens, top_k]
  void* out = nullptr;             // [tokens, hidden], rows out_stride apart
  int64_t out_stride = 0;
  int64_t tokens = 0;
  int top_k = 0, hidden = 0;
  DType dtype = DType::kBFloat16;
};
cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream);

constexpr int kPageSize = 16;  // the attention kernels' page size (one 16-token MMA tile per page)
constexpr int kMaxGroupSize = 16;  // decode packs a KV head's query heads into one 16-row MMA tile

// Gumbel-max sampling: out[b] = argmax over v of x[b, v] + gumbel(keys[b], v), the noise being
// rollout_service/ops/random.py's hash through the reference's float steps. The vocabulary is cut into
// num_chunks chunks of `chunk` tokens (one CTA each); with more than one, chunk_value / chunk_index
// [batch, num_chunks] hold each chunk's winner for a second, combining launch.
struct GumbelArgmaxParams {
  const float* x = nullptr;  // [batch, vocab], rows row_stride apart
  int64_t row_stride = 0;
  const int64_t* keys = nullptr;  // [batch], the uint64 row keys as int64
  int64_t* out = nullptr;         // [batch]
  float* chunk_value = nullptr;
  int64_t* chunk_index = nullptr;
  int64_t batch = 0, vocab = 0, chunk = 0;
  int num_chunks = 1;
};
int gumbel_argmax_chunks(int64_t batch, int64_t vocab, int num_sms);
cudaError_t gumbel_argmax(const GumbelArgmaxParams& p, cudaStream_t stream);

// argmax and logsumexp of each row in one read: tokens[b] and values[b] are torch's x[b].max() (NaN the
// largest, the first index on ties; values[b] = x[b, tokens[b]]), lse[b] is torch's x[b].logsumexp() (NaN
// if the row has a NaN, else +inf if it has a +inf; -inf for an all -inf row). One CTA per chunk of a
// constant number of tokens: with argmax_logsumexp_chunks(vocab) > 1, chunk_value / chunk_index / chunk_sum
// [batch, chunks] hold each chunk's part for a second, combining launch. The chunks depend on the vocabulary
// only, so a row's results are bitwise the same in any batch and at any row address.
struct ArgmaxLogsumexpParams {
  const float* x = nullptr;  // [batch, vocab], rows row_stride apart
  int64_t row_stride = 0;
  int64_t* tokens = nullptr;  // [batch]
  float* values = nullptr;    // [batch]
  float* lse = nullptr;       // [batch]
  float* chunk_value = nullptr;
  int64_t* chunk_index = nullptr;
  float* chunk_sum = nullptr;
  int64_t batch = 0, vocab = 0;  // batch <= 65535
};
int64_t argmax_logsumexp_chunks(int64_t vocab);
cudaError_t argmax_logsumexp(const ArgmaxLogsumexpParams& p, cudaStream_t stream);

}  // namespace rollout_kernels
