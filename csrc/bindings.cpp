// The only torch-aware file of csrc: checks tensors (clear ValueErrors), picks the current CUDA stream,
// allocates outputs/workspaces, and calls the torch-free launchers of kernels.h.
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "kernels.h"

namespace rk = rollout_kernels;

namespace {

rk::DType half_dtype(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kBFloat16) return rk::DType::kBFloat16;
  if (t.scalar_type() == at::kHalf) return rk::DType::kFloat16;
  TORCH_CHECK_VALUE(false, name, " must be bfloat16 or float16, got ", t.scalar_type());
}

void check_cuda(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), ", expected ", ref.device());
}

void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.scalar_type() == ref.scalar_type(), name, " has dtype ", t.scalar_type(), ", expected ",
                    ref.scalar_type());
}

void check_index(const at::Tensor& t, const char* name, at::ScalarType type, const at::Tensor& ref) {
  check_cuda(t, name, ref);
  TORCH_CHECK_VALUE(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), name, " must be a contiguous 1-D tensor");
}

// [rows, heads, D] with a unit last stride and even outer strides (32-bit fragment loads).
void check_heads(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 3, name, " must be [tokens, heads, head_dim], got ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(2) == 1 && t.stride(0) % 2 == 0 && t.stride(1) % 2 == 0 &&
                        reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0,
                    name, " needs a contiguous head_dim, even strides and 4-byte alignment, got strides ",
                    t.strides());
}

void check_cache(const at::Tensor& cache, const at::Tensor& ref) {
  check_cuda(cache, "kv_cache", ref);
  check_same_dtype(cache, "kv_cache", ref);
  TORCH_CHECK_VALUE(cache.dim() == 5 && cache.size(1) == 2 && cache.is_contiguous(),
                    "kv_cache must be a contiguous [num_pages, 2, num_kv_heads, page_size, head_dim] tensor, got ",
                    cache.sizes());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " launch failed: ", cudaGetErrorString(err));
}

int64_t aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

int64_t num_sms(const at::Tensor& t) {
  static int counts[64] = {};  // per device: queried once, read on every linear layer's launch
  const int dev = t.device().index();
  if (dev >= 0 && dev < 64 && counts[dev] > 0) return counts[dev];
  int count = 0;
  check_launch(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev), "SM count query");
  if (dev >= 0 && dev < 64) counts[dev] = count;
  return count;
}

// ---- norms -----------------------------------------------------------------------------------------

void check_rows(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  check_cuda(t, name, ref);
  check_same_dtype(t, name, ref);
  TORCH_CHECK_VALUE(t.dim() == 2 && t.sizes() == ref.sizes(), name, " must be 2-D of shape ", ref.sizes(), ", got ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.stride(1) == 1 && t.stride(0) % 8 == 0 && aligned16(t), name,
                    " rows must be contiguous and 16-byte aligned");
}

// x [rows, hidden] (and the residual) as the norm kernels read them, the weight [hidden]; x's dtype.
rk::DType check_norm_inputs(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight) {
  const rk::DType dtype = half_dtype(x, "x");
  check_rows(x, "x", x);
  if (residual) check_rows(*residual, "residual", x);
  check_cuda(weight, "weight", x);
  check_same_dtype(weight, "weight", x);
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() && aligned16(weight),
                    "weight must be a contiguous [", x.size(1), "] tensor");
  TORCH_CHECK_VALUE(x.size(1) % 8 == 0, "hidden size must be a multiple of 8, got ", x.size(1));
  return dtype;
}

void norm_impl(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& residual,
               const at::Tensor& weight, double eps) {
  const rk::DType dtype = check_norm_inputs(x, residual, weight);
  check_rows(out, "out", x);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(rk::rms_norm(out.data_ptr(), x.data_ptr(), residual ? residual->data_ptr() : nullptr,
                            weight.data_ptr(), dtype, x.size(0), x.size(1), out.stride(0), x.stride(0),
                            residual ? residual->stride(0) : 0, static_cast<float>(eps),
                            c10::cuda::getCurrentCUDAStream().stream()),
               "rms_norm");
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  const rk::DType dtype = half_dtype(x, "x");
  check_cuda(out, "out", x);
  check_same_dtype(out, "out", x);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % 16 == 0, "x must be [rows, 2 * inter] with inter a multiple of 8, "
                    "got ", x.sizes());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == x.size(1) / 2,
                    "out must be [", x.size(0), ", ", x.size(1) / 2, "], got ", out.sizes());
  for (const at::Tensor* t : {&x, &out}) {
    TORCH_CHECK_VALUE(t->stride(1) == 1 && t->stride(0) % 8 == 0 && aligned16(*t),
                      "x and out rows must be contiguous and 16-byte aligned");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(rk::silu_and_mul(out.data_ptr(), x.data_ptr(), dtype, x.size(0), out.size(1), out.stride(0),
                                x.stride(0), c10::cuda::getCurrentCUDAStream().stream()),
               "silu_and_mul");
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  norm_impl(out, x, std::nullopt, weight, eps);
}

void add_rms_norm(at::Tensor out, at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  norm_impl(out, x, residual, weight, eps);
}

// ---- FP8 activations (e4m3 rows + float32 per-row scales) ---------------------------------------------

void check_fp8_out(const at::Tensor& q, const at::Tensor& scale, int64_t rows, int64_t cols, const at::Tensor& ref) {
  check_cuda(q, "q", ref);
  check_cuda(scale, "scale", ref);
  TORCH_CHECK_VALUE(q.scalar_type() == at::kFloat8_e4m3fn, "q must be float8_e4m3fn, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 2 && q.size(0) == rows && q.size(1) == cols && q.is_contiguous() && aligned16(q),
                    "q must be a contiguous 16-byte aligned [", rows, ", ", cols, "] tensor, got ", q.sizes());
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == rows &&
                        scale.is_contiguous(),
                    "scale must be a contiguous float32 [", rows, "] tensor");
}

void fp8_quantize(at::Tensor q, at::Tensor scale, at::Tensor x) {
  const rk::DType dtype = half_dtype(x, "x");
  check_rows(x, "x", x);
  TORCH_CHECK_VALUE(x.size(1) % 8 == 0, "x's row length must be a multiple of 8, got ", x.size(1));
  check_fp8_out(q, scale, x.size(0), x.size(1), x);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(rk::fp8_quantize(q.data_ptr(), scale.data_ptr<float>(), x.data_ptr(), dtype, x.size(0), x.size(1),
                                x.stride(0), c10::cuda::getCurrentCUDAStream().stream()),
               "fp8_quantize");
}

void rms_norm_fp8(at::Tensor q, at::Tensor scale, at::Tensor x, std::optional<at::Tensor> residual,
                  at::Tensor weight, double eps) {
  const rk::DType dtype = check_norm_inputs(x, residual, weight);
  check_fp8_out(q, scale, x.size(0), x.size(1), x);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(rk::rms_norm_fp8(q.data_ptr(), scale.data_ptr<float>(), x.data_ptr(),
                                residual ? residual->data_ptr() : nullptr, weight.data_ptr(), dtype, x.size(0),
                                x.size(1), x.stride(0), residual ? residual->stride(0) : 0, static_cast<float>(eps),
                                c10::cuda::getCurrentCUDAStream().stream()),
               "rms_norm_fp8");
}

void silu_and_mul_fp8(at::Tensor q, at::Tensor scale, at::Tensor x) {
  const rk::DType dtype = half_dtype(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) % 16 == 0, "x must be [rows, 2 * inter] with inter a multiple of 8, "
                    "got ", x.sizes());
  TORCH_CHECK_VALUE(x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x),
                    "x rows must be contiguous and 16-byte aligned");
  check_fp8_out(q, scale, x.size(0), x.size(1) / 2, x);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(rk::silu_and_mul_fp8(q.data_ptr(), scale.data_ptr<float>(), x.data_ptr(), dtype, x.size(0),
                                    x.size(1) / 2, x.stride(0), c10::cuda::getCurrentCUDAStream().stream()),
               "silu_and_mul_fp8");
}

// ---- rope / kv write -------------------------------------------------------------------------------

rk::RopeKVParams rope_params(const at::Tensor& k) {
  rk::RopeKVParams p;
  p.dtype = half_dtype(k, "k");
  check_heads(k, "k");
  p.k = k.data_ptr();
  p.k_stride_t = k.stride(0);
  p.k_stride_h = k.stride(1);
  p.num_tokens = static_cast<int>(k.size(0));
  p.num_kv_heads = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(k.size(2));
  return p;
}

void add_rope(rk::RopeKVParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
              const at::Tensor& cos_sin) {
  check_cuda(q, "q", k);
  check_same_dtype(q, "q", k);
  check_heads(q, "q");
  TORCH_CHECK_VALUE(q.size(0) == k.size(0) && q.size(2) == k.size(2), "q ", q.sizes(), " and k ", k.sizes(),
                    " disagree on tokens or head_dim");
  check_index(positions, "positions", at::kLong, k);
  TORCH_CHECK_VALUE(positions.size(0) == k.size(0), "positions has ", positions.size(0), " entries for ",
                    k.size(0), " tokens");
  check_cuda(cos_sin, "cos_sin", k);
  TORCH_CHECK_VALUE(cos_sin.dim() == 2 && cos_sin.size(1) == k.size(2) && cos_sin.is_contiguous(),
                    "cos_sin must be a contiguous [max_positions, head_dim] table, got ", cos_sin.sizes());
  if (cos_sin.scalar_type() == at::kFloat) {
    p.cos_sin_dtype = rk::DType::kFloat32;
  } else {
    check_same_dtype(cos_sin, "cos_sin", k);
    p.cos_sin_dtype = p.dtype;
  }
  p.q = q.data_ptr();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.positions = positions.data_ptr<int64_t>();
  p.cos_sin = cos_sin.data_ptr();
  p.apply_rope = true;
}

void add_cache(rk::RopeKVParams& p, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
               const at::Tensor& slot_mapping) {
  check_cuda(v, "v", k);
  check_same_dtype(v, "v", k);
  check_heads(v, "v");
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "v ", v.sizes(), " must match k ", k.sizes());
  check_cache(kv_cache, k);
  TORCH_CHECK_VALUE(kv_cache.size(2) == k.size(1) && kv_cache.size(4) == k.size(2), "kv_cache ", kv_cache.sizes(),
                    " does not fit k ", k.sizes());
  check_index(slot_mapping, "slot_mapping", at::kLong, k);
  TORCH_CHECK_VALUE(slot_mapping.size(0) == k.size(0), "slot_mapping has ", slot_mapping.size(0), " entries for ",
                    k.size(0), " tokens");
  p.v = v.data_ptr();
  p.v_stride_t = v.stride(0);
  p.v_stride_h = v.stride(1);
  p.kv_cache = kv_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.page_size = static_cast<int>(kv_cache.size(3));
}

void run_rope_kv(const rk::RopeKVParams& p, const at::Tensor& k) {
  const c10::cuda::CUDAGuard guard(k.device());
  check_launch(rk::rope_kv(p, c10::cuda::getCurrentCUDAStream().stream()), "rope_kv");
}

// q and k rotated in place.
void rope(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos_sin) {
  rk::RopeKVParams p = rope_params(k);
  add_rope(p, q, k, positions, cos_sin);
  run_rope_kv(p, k);
}

void write_kv(at::Tensor kv_cache, at::Tensor k, at::Tensor v, at::Tensor slot_mapping) {
  rk::RopeKVParams p = rope_params(k);
  p.apply_rope = false;
  add_cache(p, k, v, kv_cache, slot_mapping);
  run_rope_kv(p, k);
}

// q and k rotated in place, rotated k and v stored at slot_mapping.
void rope_write_kv(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos_sin,
                   at::Tensor kv_cache, at::Tensor slot_mapping) {
  rk::RopeKVParams p = rope_params(k);
  add_rope(p, q, k, positions, cos_sin);
  add_cache(p, k, v, kv_cache, slot_mapping);
  run_rope_kv(p, k);
}

// ---- batch-1 linear layers -------------------------------------------------------------------------

// out = x @ weight.T (+ bias) for one row x [1, k]; gated: out = silu(y[:, :n]) * y[:, n:] of
// y = x @ weight.T (+ bias).
void gemv(at::Tensor out, at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias, bool gated) {
  rk::GemvParams p;
  p.dtype = half_dtype(x, "x");
  check_cuda(weight, "weight", x);
  check_same_dtype(weight, "weight", x);
  check_cuda(out, "out", x);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) == 1 && x.stride(1) == 1 && aligned16(x) && x.size(1) % 8 == 0,
                    "x must be one contiguous 16-byte aligned row [1, k] with k % 8 == 0, got ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(1) && weight.is_contiguous() && aligned16(weight),
                    "weight must be a contiguous 16-byte aligned [n, ", x.size(1), "] tensor, got ", weight.sizes());
  TORCH_CHECK_VALUE(!gated || weight.size(0) % 2 == 0, "a gated weight needs an even number of rows");
  const int64_t n = gated ? weight.size(0) / 2 : weight.size(0);
  if (bias) {
    check_cuda(*bias, "bias", x);
    check_same_dtype(*bias, "bias", x);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(), "bias must be [",
                      weight.size(0), "]");
  }
  const bool out_float = out.scalar_type() == at::kFloat;
  TORCH_CHECK_VALUE(out_float ? !gated : out.scalar_type() == x.scalar_type(), "out must be ",
                    gated ? "of x's dtype" : "float32 or of x's dtype", ", got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == 1 && out.size(1) == n && out.stride(1) == 1,
                    "out must be a contiguous [1, ", n, "] row, got ", out.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(x.size(1));
  p.gated = gated;
  p.out_float = out_float;
  p.split = rk::gemv_split(p.n, p.k, static_cast<int>(num_sms(x)));
  check_launch(rk::gemv(p, c10::cuda::getCurrentCUDAStream().stream()), "gemv");
}

// One row's FP8 product: out [1, n] = x [1, k] e4m3 times weight [n, k] e4m3, scaled by x_scale [1] and
// w_scale [n] (float32), + bias; rounded to out's dtype (bf16 / fp16).
void fp8_gemv(at::Tensor out, at::Tensor x, at::Tensor x_scale, at::Tensor weight, at::Tensor w_scale,
              std::optional<at::Tensor> bias) {
  rk::GemvFp8Params p;
  p.dtype = half_dtype(out, "out");
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&x, "x"}, {&weight, "weight"}}) {
    check_cuda(*t, name, out);
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat8_e4m3fn, name, " must be float8_e4m3fn, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->dim() == 2 && t->is_contiguous() && aligned16(*t), name,
                      " must be a contiguous 16-byte aligned 2-D tensor, got ", t->sizes());
  }
  TORCH_CHECK_VALUE(x.size(0) == 1 && x.size(1) % 16 == 0, "x must be one row [1, k] with k % 16 == 0, got ",
                    x.sizes());
  TORCH_CHECK_VALUE(weight.size(1) == x.size(1), "weight must be [n, ", x.size(1), "], got ", weight.sizes());
  const int64_t n = weight.size(0);
  TORCH_CHECK_VALUE(n < (int64_t(1) << 31), "weight has too many rows: ", n);
  for (const auto& [t, len, name] : {std::tuple<const at::Tensor*, int64_t, const char*>{&x_scale, 1, "x_scale"},
                                     {&w_scale, n, "w_scale"}}) {
    check_cuda(*t, name, out);
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->numel() == len && t->is_contiguous(), name,
                      " must be a contiguous float32 tensor of ", len, " elements");
  }
  if (bias) {
    check_cuda(*bias, "bias", out);
    check_same_dtype(*bias, "bias", out);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(), "bias must be [", n, "]");
  }
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == 1 && out.size(1) == n && out.is_contiguous(),
                    "out must be a contiguous [1, ", n, "] row, got ", out.sizes());
  const c10::cuda::CUDAGuard guard(out.device());
  p.x = x.data_ptr();
  p.x_scale = x_scale.data_ptr<float>();
  p.weight = weight.data_ptr();
  p.w_scale = w_scale.data_ptr<float>();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(x.size(1));
  p.split = rk::gemv_fp8_split(p.n, p.k, static_cast<int>(num_sms(out)));
  check_launch(rk::gemv_fp8(p, c10::cuda::getCurrentCUDAStream().stream()), "fp8_gemv");
}

// ---- mixture of experts ----------------------------------------------------------------------------

void check_ids(const at::Tensor& ids, const at::Tensor& ref) {
  check_cuda(ids, "ids", ref);
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kInt && ids.dim() == 2 && ids.is_contiguous(),
                    "ids must be a contiguous int32 [tokens, top_k] tensor, got ", ids.scalar_type(), " ", ids.sizes());
  TORCH_CHECK_VALUE(ids.size(1) >= 1 && ids.size(1) <= rk::kMoeMaxTopK, "top_k must be in 1..", rk::kMoeMaxTopK,
                    ", got ", ids.size(1));
}

void check_stacked(const at::Tensor& w, const char* name, const at::Tensor& x) {
  check_cuda(w, name, x);
  check_same_dtype(w, name, x);
  TORCH_CHECK_VALUE(w.dim() == 3 && w.is_contiguous() && aligned16(w), name,
                    " must be a contiguous 16-byte aligned [experts, out, in] tensor, got ", w.sizes());
}

// (ids int32 [T, k], weights float32 [T, k]) of router logits [T, E]; with record ([slots, k] uint8 or int16,
// unit last stride) and slots (int64 [T]), the ids are also written at each token's slot.
std::tuple<at::Tensor, at::Tensor> moe_route(at::Tensor logits, int64_t top_k, bool renormalize,
                                             std::optional<at::Tensor> record, std::optional<at::Tensor> slots) {
  rk::MoeRouteParams p;
  p.dtype = half_dtype(logits, "logits");
  check_cuda(logits, "logits", logits);
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [tokens, experts] with contiguous rows");
  TORCH_CHECK_VALUE(logits.size(1) >= 1 && logits.size(1) <= rk::kMoeMaxExperts, "experts must be in 1..",
                    rk::kMoeMaxExperts, ", got ", logits.size(1));
  TORCH_CHECK_VALUE(top_k >= 1 && top_k <= std::min<int64_t>(rk::kMoeMaxTopK, logits.size(1)), "top_k must be in 1..",
                    std::min<int64_t>(rk::kMoeMaxTopK, logits.size(1)), ", got ", top_k);
  TORCH_CHECK_VALUE(record.has_value() == slots.has_value(), "record and slots come together");
  if (record) {
    check_cuda(*record, "record", logits);
    const bool wide = record->scalar_type() == at::kShort;
    TORCH_CHECK_VALUE(wide || record->scalar_type() == at::kByte, "record must be uint8 or int16, got ",
                      record->scalar_type());
    TORCH_CHECK_VALUE(record->dim() == 2 && record->size(1) == top_k && record->stride(1) == 1,
                      "record must be [slots, ", top_k, "] with a unit last stride, got ", record->sizes());
    check_index(*slots, "slots", at::kLong, logits);
    TORCH_CHECK_VALUE(slots->size(0) == logits.size(0), "slots has ", slots->size(0), " entries for ",
                      logits.size(0), " tokens");
    p.record = record->data_ptr();
    p.record_stride = record->stride(0);
    p.record_wide = wide;
    p.slots = slots->data_ptr<int64_t>();
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor ids = at::empty({logits.size(0), top_k}, logits.options().dtype(at::kInt));
  at::Tensor weights = at::empty({logits.size(0), top_k}, logits.options().dtype(at::kFloat));
  p.logits = logits.data_ptr();
  p.logits_stride = logits.stride(0);
  p.ids = ids.data_ptr<int>();
  p.weights = weights.data_ptr<float>();
  p.tokens = static_cast<int>(logits.size(0));
  p.experts = static_cast<int>(logits.size(1));
  p.top_k = static_cast<int>(top_k);
  p.renormalize = renormalize;
  check_launch(rk::moe_route(p, c10::cuda::getCurrentCUDAStream().stream()), "moe_route");
  return {ids, weights};
}

// Each (token, slot) row through its own expert's weight [E, n (2n when gated), k]: x is [tokens, k] (the first
// product: row r reads token r / top_k) or [tokens * top_k, k] (the second); out [tokens * top_k, n].
at::Tensor moe_gemv(at::Tensor x, at::Tensor weight, at::Tensor ids, bool gated) {
  rk::GemvParams p;
  p.dtype = half_dtype(x, "x");
  check_ids(ids, x);
  check_stacked(weight, "weight", x);
  const int64_t rows = ids.numel();
  TORCH_CHECK_VALUE(rows <= 65535, "moe_gemv takes at most 65535 rows, got ", rows);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x) && x.size(1) % 8 == 0 &&
                        x.size(1) == weight.size(2),
                    "x must have contiguous 16-byte aligned rows of ", weight.size(2), " elements, got ", x.sizes());
  TORCH_CHECK_VALUE(x.size(0) == ids.size(0) || x.size(0) == rows, "x must have one row per token (", ids.size(0),
                    ") or per slot (", rows, "), got ", x.size(0));
  TORCH_CHECK_VALUE(!gated || weight.size(1) % 2 == 0, "a gated weight needs an even number of rows");
  const int64_t n = gated ? weight.size(1) / 2 : weight.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({rows, n}, x.options());
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.out = out.data_ptr();
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(x.size(1));
  p.gated = gated;
  p.rows = static_cast<int>(rows);
  p.x_div = x.size(0) == rows ? 1 : static_cast<int>(ids.size(1));
  p.x_stride = x.stride(0);
  p.out_stride = n;
  p.expert_ids = ids.data_ptr<int>();
  p.expert_stride = weight.stride(0);
  p.split = rk::gemv_split(n * rows, p.k, static_cast<int>(num_sms(x)));
  check_launch(rk::gemv(p, c10::cuda::getCurrentCUDAStream().stream()), "moe_gemv");
  return out;
}

// (grouped [T * k, H], offsets int32 [E], position int32 [T * k]) of x [T, H] under ids [T, k] (see kernels.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_permute(at::Tensor x, at::Tensor ids, int64_t num_experts) {
  rk::MoePermuteParams p;
  p.dtype = half_dtype(x, "x");
  check_ids(ids, x);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) == ids.size(0) && x.stride(1) == 1 && x.stride(0) % 8 == 0 &&
                        aligned16(x) && x.size(1) % 8 == 0,
                    "x must be [", ids.size(0), ", hidden] with contiguous 16-byte aligned rows, hidden % 8 == 0; got ",
                    x.sizes());
  TORCH_CHECK_VALUE(num_experts >= 1 && num_experts < 65536, "num_experts must be in 1..65535, got ", num_experts);
  TORCH_CHECK_VALUE(ids.numel() < (int64_t(1) << 31), "too many rows: ", ids.numel());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor grouped = at::empty({ids.numel(), x.size(1)}, x.options());
  at::Tensor offsets = at::empty({num_experts}, ids.options());
  at::Tensor position = at::empty({ids.numel()}, ids.options());
  p.ids = ids.data_ptr<int>();
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.grouped = grouped.data_ptr();
  p.offsets = offsets.data_ptr<int>();
  p.position = position.data_ptr<int>();
  p.slots = static_cast<int>(ids.numel());
  p.top_k = static_cast<int>(ids.size(1));
  p.experts = static_cast<int>(num_experts);
  p.hidden = static_cast<int>(x.size(1));
  check_launch(rk::moe_permute(p, c10::cuda::getCurrentCUDAStream().stream()), "moe_permute");
  return {grouped, offsets, position};
}

// [T, H]: the weighted sum over each token's k rows of y [T * k, H] (rows position[t * k + s], or t * k + s).
at::Tensor moe_combine(at::Tensor y, std::optional<at::Tensor> position, at::Tensor weights) {
  rk::MoeCombineParams p;
  p.dtype = half_dtype(y, "y");
  check_cuda(weights, "weights", y);
  TORCH_CHECK_VALUE(weights.scalar_type() == at::kFloat && weights.dim() == 2 && weights.is_contiguous() &&
                        weights.size(1) >= 1,
                    "weights must be a contiguous float32 [tokens, top_k] tensor, got ", weights.sizes());
  TORCH_CHECK_VALUE(y.dim() == 2 && y.is_contiguous() && aligned16(y) && y.size(1) % 8 == 0 &&
                        y.size(0) == weights.numel(),
                    "y must be a contiguous [", weights.numel(), ", hidden] tensor with hidden % 8 == 0, got ", y.sizes());
  if (position) {
    check_index(*position, "position", at::kInt, y);
    TORCH_CHECK_VALUE(position->size(0) == y.size(0), "position needs ", y.size(0), " entries");
    p.position = position->data_ptr<int>();
  }
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor out = at::empty({weights.size(0), y.size(1)}, y.options());
  p.y = y.data_ptr();
  p.weights = weights.data_ptr<float>();
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.tokens = weights.size(0);
  p.top_k = static_cast<int>(weights.size(1));
  p.hidden = static_cast<int>(y.size(1));
  check_launch(rk::moe_combine(p, c10::cuda::getCurrentCUDAStream().stream()), "moe_combine");
  return out;
}

// ---- batch-invariant linear layers -----------------------------------------------------------------

// out = x @ weight.T (+ bias) as x.size(0) / rows cuBLAS products of exactly `rows` rows (the caller pads x).
// cuBLAS picks its kernel, and with it every output's summation order, from the shape: one shape for every call
// makes a row's bits independent of the rows that come with it (rollout_service/ops/invariant_cuda.py). The
// loop is here, not in Python, to keep a long prefill's per-chunk overhead small; its chunks run on up to
// kInvariantLinearStreams streams, because one 256-row product leaves most SMs idle on a large weight, and
// each product is computed alone in any case (no atomics, no shared workspace), so the bits do not change.
constexpr int kInvariantLinearStreams = 4;

void fixed_rows_linear(at::Tensor out, at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias,
                       int64_t rows) {
  check_cuda(weight, "weight", x);
  check_cuda(out, "out", x);
  check_same_dtype(weight, "weight", x);
  check_same_dtype(out, "out", x);
  TORCH_CHECK_VALUE(rows > 0 && x.dim() == 2 && x.size(0) % rows == 0 && x.is_contiguous(),
                    "x must be a contiguous [k * ", rows, ", in] tensor, got ", x.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == x.size(1), "weight must be [out, ", x.size(1), "], got ",
                    weight.sizes());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == weight.size(0) && out.is_contiguous(),
                    "out must be a contiguous [", x.size(0), ", ", weight.size(0), "] tensor, got ", out.sizes());
  if (bias) {
    check_cuda(*bias, "bias", x);
    check_same_dtype(*bias, "bias", x);
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "bias must be [", weight.size(0), "]");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor wt = weight.t();
  const int64_t chunks = x.size(0) / rows;
  const int lanes = static_cast<int>(std::min<int64_t>(chunks, kInvariantLinearStreams));
  const c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream();
  std::vector<c10::cuda::CUDAStream> streams;
  if (lanes > 1) {  // fork: every lane waits for x
    at::cuda::CUDAEvent ready;
    ready.record(main);
    for (int i = 0; i < lanes; ++i) {
      streams.push_back(c10::cuda::getStreamFromPool(false, x.get_device()));
      ready.block(streams.back());
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    std::optional<c10::cuda::CUDAStreamGuard> lane;
    if (lanes > 1) lane.emplace(streams[c % lanes]);
    at::Tensor o = out.narrow(0, c * rows, rows);
    const at::Tensor xs = x.narrow(0, c * rows, rows);
    if (bias) {
      at::addmm_out(o, *bias, xs, wt);
    } else {
      at::mm_out(o, xs, wt);
    }
  }
  for (auto& s : streams) {  // join: the caller's stream waits for every lane
    at::cuda::CUDAEvent done;
    done.record(s);
    done.block(main);
  }
}

// ---- attention -------------------------------------------------------------------------------------

rk::PagedKV paged_kv(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indptr,
                     const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len) {
  half_dtype(q, "q");
  check_cuda(q, "q", q);
  check_heads(q, "q");
  check_cache(kv_cache, q);
  TORCH_CHECK_VALUE(kv_cache.size(3) == rk::kPageSize, "the attention kernels need page_size ", rk::kPageSize,
                    ", got ", kv_cache.size(3));
  TORCH_CHECK_VALUE(kv_cache.size(4) == q.size(2), "kv_cache head_dim ", kv_cache.size(4), " != q head_dim ",
                    q.size(2));
  TORCH_CHECK_VALUE(q.size(2) == 64 || q.size(2) == 128, "head_dim must be 64 or 128, got ", q.size(2));
  TORCH_CHECK_VALUE(q.size(1) % kv_cache.size(2) == 0, q.size(1), " query heads do not group over ",
                    kv_cache.size(2), " kv heads");
  check_index(kv_indptr, "kv_indptr", at::kInt, q);
  check_index(kv_indices, "kv_indices", at::kInt, q);
  check_index(kv_last_page_len, "kv_last_page_len", at::kInt, q);
  TORCH_CHECK_VALUE(kv_last_page_len.size(0) == kv_indptr.size(0) - 1, "kv_last_page_len needs ",
                    kv_indptr.size(0) - 1, " entries");
  rk::PagedKV kv;
  kv.cache = kv_cache.data_ptr();
  kv.kv_indptr = kv_indptr.data_ptr<int>();
  kv.kv_indices = kv_indices.data_ptr<int>();
  kv.kv_last_page_len = kv_last_page_len.data_ptr<int>();
  kv.num_kv_heads = static_cast<int>(kv_cache.size(2));
  return kv;
}

// The decode kernel's choice: a split count, or -1 for one warp per (sequence, kv head).
int64_t decode_num_splits(at::Tensor q, int64_t num_kv_heads, int64_t max_kv_len) {
  const int max_pages = static_cast<int>((max_kv_len + rk::kPageSize - 1) / rk::kPageSize);
  const int batch = static_cast<int>(q.size(0)), hk = static_cast<int>(num_kv_heads);
  const int sms = static_cast<int>(num_sms(q));
  if (rk::decode_warp_per_head(batch, hk, max_pages, sms)) return -1;
  return rk::decode_num_splits(batch, hk, max_pages, sms);
}

// num_splits > 0: that many splits; -1: one warp per (sequence, kv head); 0: chosen from the batch, the KV
// heads, max_kv_len and the SM count.
at::Tensor decode_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor kv_indptr, at::Tensor kv_indices,
                            at::Tensor kv_last_page_len, double scale, int64_t max_kv_len, int64_t num_splits) {
  rk::DecodeParams p;
  p.kv = paged_kv(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len);
  TORCH_CHECK_VALUE(kv_indptr.size(0) == q.size(0) + 1, "decode needs one query per sequence: q has ", q.size(0),
                    " rows for ", kv_indptr.size(0) - 1, " sequences");
  TORCH_CHECK_VALUE(q.size(1) / kv_cache.size(2) <= rk::kMaxGroupSize, "decode packs at most ",
                    rk::kMaxGroupSize, " query heads per kv head, got ", q.size(1) / kv_cache.size(2));
  TORCH_CHECK_VALUE(num_splits >= -1, "num_splits must be >= -1, got ", num_splits);
  const c10::cuda::CUDAGuard guard(q.device());
  p.dtype = half_dtype(q, "q");
  p.q = q.data_ptr();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.batch = static_cast<int>(q.size(0));
  p.num_q_heads = static_cast<int>(q.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  p.scale = static_cast<float>(scale);
  const int64_t choice = num_splits != 0 ? num_splits : decode_num_splits(q, p.kv.num_kv_heads, max_kv_len);
  p.warp_per_head = choice == -1;
  p.num_splits = static_cast<int>(p.warp_per_head ? 1 : choice);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor partial_out, partial_lse;
  if (p.num_splits > 1) {
    partial_out = at::empty({p.num_splits, q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
    partial_lse = at::empty({p.num_splits, q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_lse = partial_lse.data_ptr<float>();
  }
  p.out = out.data_ptr();
  check_launch(rk::decode_attention(p, c10::cuda::getCurrentCUDAStream().stream()), "decode_attention");
  return out;
}

at::Tensor prefill_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor qo_indptr, at::Tensor kv_indptr,
                             at::Tensor kv_indices, at::Tensor kv_last_page_len, int64_t max_q_len, double scale,
                             bool exact_pv, int64_t impl) {
  rk::PrefillParams p;
  p.kv = paged_kv(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len);
  check_index(qo_indptr, "qo_indptr", at::kInt, q);
  TORCH_CHECK_VALUE(qo_indptr.size(0) == kv_indptr.size(0), "qo_indptr and kv_indptr must both have B+1 entries");
  TORCH_CHECK_VALUE(max_q_len >= 0, "max_q_len must be >= 0");
  TORCH_CHECK_VALUE(impl == 0 || impl == 1, "impl must be 0 (auto) or 1 (mma.sync), got ", impl);
  const c10::cuda::CUDAGuard guard(q.device());
  p.dtype = half_dtype(q, "q");
  p.q = q.data_ptr();
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.qo_indptr = qo_indptr.data_ptr<int>();
  p.batch = static_cast<int>(qo_indptr.size(0) - 1);
  p.num_q_heads = static_cast<int>(q.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  p.max_q_len = static_cast<int>(max_q_len);
  p.scale = static_cast<float>(scale);
  p.exact_pv = exact_pv;
  p.impl = static_cast<rk::PrefillImpl>(impl);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  p.out = out.data_ptr();
  check_launch(rk::prefill_attention(p, c10::cuda::getCurrentCUDAStream().stream()), "prefill_attention");
  return out;
}

// ---- sampling --------------------------------------------------------------------------------------

at::Tensor gumbel_argmax(at::Tensor x, at::Tensor keys) {
  TORCH_CHECK_VALUE(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "x must be a float32 CUDA [batch, vocab] tensor with contiguous rows, got ", x.scalar_type(),
                    " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK_VALUE(x.size(1) > 0 && x.size(0) <= 65535, "x must have at most 65535 rows and a vocabulary, got ", x.sizes());
  check_index(keys, "keys", at::kLong, x);
  TORCH_CHECK_VALUE(keys.size(0) == x.size(0), "keys has ", keys.size(0), " entries for ", x.size(0), " rows");
  const c10::cuda::CUDAGuard guard(x.device());
  rk::GumbelArgmaxParams p;
  p.x = x.data_ptr<float>();
  p.row_stride = x.stride(0);
  p.keys = keys.data_ptr<int64_t>();
  p.batch = x.size(0);
  p.vocab = x.size(1);
  p.num_chunks = rk::gumbel_argmax_chunks(p.batch, p.vocab, static_cast<int>(num_sms(x)));
  p.chunk = (p.vocab + p.num_chunks - 1) / p.num_chunks;
  at::Tensor out = at::empty({x.size(0)}, keys.options());
  at::Tensor chunk_value, chunk_index;
  if (p.num_chunks > 1) {
    chunk_value = at::empty({x.size(0), p.num_chunks}, x.options());
    chunk_index = at::empty({x.size(0), p.num_chunks}, keys.options());
    p.chunk_value = chunk_value.data_ptr<float>();
    p.chunk_index = chunk_index.data_ptr<int64_t>();
  }
  p.out = out.data_ptr<int64_t>();
  check_launch(rk::gumbel_argmax(p, c10::cuda::getCurrentCUDAStream().stream()), "gumbel_argmax");
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> argmax_logsumexp(at::Tensor x) {
  TORCH_CHECK_VALUE(x.is_cuda() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
                    "x must be a float32 CUDA [batch, vocab] tensor with contiguous rows, got ", x.scalar_type(),
                    " ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK_VALUE(x.size(1) > 0 && x.size(0) <= 65535, "x must have at most 65535 rows and a vocabulary, got ", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  rk::ArgmaxLogsumexpParams p;
  p.x = x.data_ptr<float>();
  p.row_stride = x.stride(0);
  p.batch = x.size(0);
  p.vocab = x.size(1);
  at::Tensor tokens = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  at::Tensor values = at::empty({x.size(0)}, x.options());
  at::Tensor lse = at::empty({x.size(0)}, x.options());
  const int64_t chunks = rk::argmax_logsumexp_chunks(p.vocab);
  at::Tensor chunk_value, chunk_index, chunk_sum;
  if (chunks > 1) {
    chunk_value = at::empty({x.size(0), chunks}, x.options());
    chunk_index = at::empty({x.size(0), chunks}, tokens.options());
    chunk_sum = at::empty({x.size(0), chunks}, x.options());
    p.chunk_value = chunk_value.data_ptr<float>();
    p.chunk_index = chunk_index.data_ptr<int64_t>();
    p.chunk_sum = chunk_sum.data_ptr<float>();
  }
  p.tokens = tokens.data_ptr<int64_t>();
  p.values = values.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  check_launch(rk::argmax_logsumexp(p, c10::cuda::getCurrentCUDAStream().stream()), "argmax_logsumexp");
  return {tokens, values, lse};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rollout_service CUDA kernels";
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :inter]) * x[:, inter:] (x [rows, 2 * inter])");
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight (x [rows, hidden])");
  m.def("add_rms_norm", &add_rms_norm, "residual += x (in place); out = rms_norm(residual) * weight");
  m.def("fp8_quantize", &fp8_quantize, "q, scale = x rows as e4m3 with float32 scales amax / 448");
  m.def("rms_norm_fp8", &rms_norm_fp8, "rms_norm (after residual += x, in place, when given) quantized to e4m3 rows");
  m.def("silu_and_mul_fp8", &silu_and_mul_fp8, "silu_and_mul quantized to e4m3 rows");
  m.def("rope", &rope, "rotate-half RoPE of q and k in place");
  m.def("write_kv", &write_kv, "store k, v [T, Hk, D] in the paged cache at slot_mapping");
  m.def("rope_write_kv", &rope_write_kv, "RoPE of q, k in place + store rotated k and v in the cache");
  m.def("gemv", &gemv, "out = x @ weight.T (+ bias) for one row; gated: silu(gate) * up of the fused gate_up");
  m.def("fp8_gemv", &fp8_gemv, "one row's FP8 product: e4m3 x and weight, float32 sums, row and channel scales");
  m.def("moe_route", &moe_route, "(ids, weights) of router logits: float32 softmax, top-k, optional renormalisation; "
        "optionally recorded at the tokens' KV slots");
  m.def("moe_gemv", &moe_gemv, "each (token, slot) row through its expert's weight (small batches)");
  m.def("moe_permute", &moe_permute, "(grouped rows, cumulative offsets, position) of tokens in expert order");
  m.def("moe_combine", &moe_combine, "weighted sum of each token's expert outputs in slot order, float32");
  m.def("fixed_rows_linear", &fixed_rows_linear,
        "out = x @ weight.T (+ bias) as cuBLAS products of exactly `rows` rows each (batch-invariant mode)");
  m.def("decode_num_splits", &decode_num_splits,
        "split-KV count the decode kernel would choose (-1: one warp per sequence and kv head)");
  m.def("decode_attention", &decode_attention, "paged decode attention (one query per sequence)");
  m.def("prefill_attention", &prefill_attention, "ragged paged causal prefill attention");
  m.def("prefill_sm90_available", &rk::prefill_sm90_available, "whether this build has the Hopper (wgmma) prefill kernel");
  m.def("gumbel_argmax", &gumbel_argmax, "argmax of x + the counter-based Gumbel noise of keys (one sample per row)");
  m.def("argmax_logsumexp", &argmax_logsumexp,
        "(tokens, values, lse) of float32 rows: x.max(dim=1) and x.logsumexp(dim=1) in one pass");
}
