"""Batch-invariant CUDA ops: the csrc kernels and cuBLAS, used so that a token's numbers never depend on its
batch mates (EngineConfig.batch_invariant on the cuda backend; the torch version is ops/invariant.py).

Where the fast CUDA path depends on the batch, and what this one does instead:

- cuBLAS picks its GEMM kernel (tile shape, split-K, stream-K) from M, so a row's summation order follows the
  number of rows. Here every product runs as cuBLAS calls of exactly GEMM_ROWS rows (the last chunk zero-padded):
  one shape, one kernel, one order, whatever the batch. A decode step of up to GEMM_ROWS sequences is one call,
  so a batch of 256 pays nothing; a prefill pays one call per GEMM_ROWS tokens (a loop in csrc/bindings.cpp
  over a few streams). The gemv kernel (batch 1) is off. Calls of a second shape, WIDE_ROWS rows, serve a long
  prefill's leading rows where, for that weight shape, they give the bits of GEMM_ROWS chunks: cuBLAS chooses
  its kernel by shape, not data, and two kernels that sum in different orders disagree somewhere on WIDE_ROWS
  random rows, so equal outputs on random rows (checked once per shape, outside any graph capture: decode never
  reaches WIDE_ROWS rows) mean one summation order.
- Decode attention chooses its split-KV and warp layout from the batch. Here it always runs in one layout
  (DECODE_LAYOUT, no split), and prefill queries run through the same kernel, one query at a time over its own
  prefix: prefill, decode, a recompute after preemption and the learner's forward give a query
  the same bits.
- torch's logsumexp on a [B, V] tensor splits rows across blocks when B is small; the sampler's normaliser here
  is the fused argmax/logsumexp kernel, whose chunks follow the vocabulary only.

- Mixture-of-experts layers: the router product as every product; softmax and top-k are row-local; the experts
  as grouped products of one CUTLASS configuration (ops/cuda_moe.py invariant_experts), never the gemv rows the fast
  path takes at small batches.

Norms, RoPE, the KV write, SiLU and the MoE combine kernels are row-local already (one CTA per row, a config from
the hidden size). Supported: bf16/fp16 weights (bf16 for MoE models, on Hopper), head_dim 64 or 128, page_size 16
(check_model and model/moe.py check_moe_backend say what is not).
"""
from __future__ import annotations

import torch

from rollout_service.ops import attention as attention_ref, cuda_moe, moe_experts
from rollout_service.ops.cuda_ops import _HALF, HEAD_DIMS, MAX_DECODE_GROUP, MAX_ROWS, PAGE_SIZE, CudaOps
from rollout_service.ops.torch_ops import TorchOps

GEMM_ROWS = 256  # rows of every cuBLAS call: a full decode batch of 256 in one call
WIDE_ROWS = 2048  # a long prefill's calls, for weight shapes where they give GEMM_ROWS chunks' bits
# The decode kernel's layout for every query (csrc/decode_attention.cu): 1 = one CTA of 4 warps per (query, kv
# head), the warps taking every 4th page, merged in warp order; -1 = one warp per (query, kv head), pages in
# order. Either is invariant; the fast path picks one per batch (csrc/NOTES.md has both measured).
DECODE_LAYOUT = 1


def _padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as a contiguous, 16-byte aligned [GEMM_ROWS * ceil(M / GEMM_ROWS), K] tensor (zero rows after
    M; at least one chunk): cuBLAS chooses its kernel by alignment too."""
    rows = x.shape[0]
    chunks = max(1, -(-rows // GEMM_ROWS))
    if chunks * GEMM_ROWS == rows and x.is_contiguous() and x.data_ptr() % 16 == 0:
        return x
    padded = x.new_zeros(chunks * GEMM_ROWS, x.shape[1])
    padded[:rows] = x
    return padded


def _fixed_row_chunks(x: torch.Tensor, product) -> torch.Tensor:
    """product(chunk) over x [M, K] cut into GEMM_ROWS-row chunks (the last zero-padded); rows past M dropped."""
    padded = _padded_rows(x)
    outs = [product(padded[i:i + GEMM_ROWS]) for i in range(0, padded.shape[0], GEMM_ROWS)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:x.shape[0]]


def per_query_pages(meta: attention_ref.AttentionMetadata, page_size: int) -> tuple[torch.Tensor, ...]:
    """(kv_indptr, kv_indices, kv_last_page_len), int32, of decode metadata with one "sequence" per query of a
    prefill: the query at position p reads its sequence's first p // page_size + 1 pages, the last holding
    p % page_size + 1 tokens. On the metadata's device, with one host sync (the number of page entries)."""
    dev = meta.positions.device
    tokens = meta.positions.shape[0]
    q_lens = (meta.qo_indptr[1:] - meta.qo_indptr[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=dev), q_lens, output_size=tokens)
    npages = meta.positions // page_size + 1
    indptr = torch.zeros(tokens + 1, dtype=torch.long, device=dev)
    indptr[1:] = npages.cumsum(0)
    total = int(indptr[-1])
    query = torch.repeat_interleave(torch.arange(tokens, device=dev), npages, output_size=total)
    page_in_seq = torch.arange(total, device=dev) - indptr[query]
    indices = meta.kv_indices[meta.kv_indptr[seq].long()[query] + page_in_seq]
    return indptr.int(), indices.int().contiguous(), (meta.positions % page_size + 1).int()


class CudaInvariantOps(CudaOps):
    """CudaOps with batch-invariant products, attention and normaliser (module docstring)."""

    name = "cuda-invariant"

    def __init__(self) -> None:
        super().__init__(exact_prefill_attention=False)
        self._expanded: tuple[attention_ref.AttentionMetadata, tuple[torch.Tensor, ...]] | None = None
        self._wide: dict[tuple, bool] = {}  # weight shape -> WIDE_ROWS products equal GEMM_ROWS chunks
        self._scratch: tuple | None = None  # the learner's scratch-page metadata (_scratch_pages)

    @staticmethod
    def check_model(config, dtype: torch.dtype, page_size: int) -> None:
        """ValueError naming what this mode does not cover (the fast backend would fall back per call to the
        torch reference, which is not batch invariant on a GPU)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        group = config.num_attention_heads // config.num_key_value_heads
        problems = [what for bad, what in (
            (dtype not in _HALF, f"dtype {str(dtype).removeprefix('torch.')} (needs bfloat16 or float16)"),
            (head_dim not in HEAD_DIMS, f"head_dim {head_dim} (needs {' or '.join(map(str, HEAD_DIMS))})"),
            (page_size != PAGE_SIZE, f"page_size {page_size} (needs {PAGE_SIZE})"),
            (group > MAX_DECODE_GROUP, f"{group} query heads per kv head (at most {MAX_DECODE_GROUP})"),
        ) if bad]
        if problems:
            raise ValueError("batch_invariant on the cuda backend does not cover " + ", ".join(problems)
                             + "; use backend 'torch' (slower) or batch_invariant off")

    # ---- products: fixed-shape cuBLAS calls ---------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        ok = (flat.is_cuda and weight.dtype == flat.dtype and weight.dim() == 2 and weight.device == flat.device
              and (bias is None or (bias.dtype == flat.dtype and bias.shape == weight.shape[:1])))
        if not ok:
            raise ValueError(f"batch-invariant linear: x {flat.dtype} {tuple(flat.shape)} on {flat.device}, weight "
                             f"{weight.dtype} {tuple(weight.shape)}: needs CUDA tensors of one dtype")
        padded = _padded_rows(flat)
        out = padded.new_empty(padded.shape[0], weight.shape[0])
        wide = padded.shape[0] // WIDE_ROWS * WIDE_ROWS if padded.shape[0] >= WIDE_ROWS else 0
        if wide and self._wide_matches(weight, bias):
            self.kernels.fixed_rows_linear(out[:wide], padded[:wide], weight, bias, WIDE_ROWS)
        else:
            wide = 0
        if wide < padded.shape[0]:
            self.kernels.fixed_rows_linear(out[wide:], padded[wide:], weight, bias, GEMM_ROWS)  # csrc/bindings.cpp
        return out[:flat.shape[0]].view(*x.shape[:-1], weight.shape[0])

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.silu_and_mul(self.linear(x, weight, bias))

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _fixed_row_chunks(hidden, lambda c: TorchOps.logits(self, c, weight))  # no gemv

    def _wide_matches(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether cuBLAS computes a WIDE_ROWS-row product of this weight shape with the same bits as its
        GEMM_ROWS-row chunks: measured once per shape on random rows (module docstring)."""
        key = (tuple(weight.shape), weight.dtype, bias is not None)
        if key not in self._wide:
            g = torch.Generator(device=weight.device).manual_seed(0)  # the caller's random stream stays as it is
            x = torch.randn(WIDE_ROWS, weight.shape[1], device=weight.device, dtype=weight.dtype, generator=g)
            wide, narrow = (torch.empty(WIDE_ROWS, weight.shape[0], device=weight.device, dtype=weight.dtype)
                            for _ in range(2))
            self.kernels.fixed_rows_linear(wide, x, weight, bias, WIDE_ROWS)
            self.kernels.fixed_rows_linear(narrow, x, weight, bias, GEMM_ROWS)
            self._wide[key] = torch.equal(wide, narrow)
        return self._wide[key]

    # ---- mixture of experts: grouped products of one configuration (ops/cuda_moe.py) ------------------

    def moe_route(self, x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                  record: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's routing over the fixed-shape router product: softmax and top-k are row-local, and the
        learner's replay (moe_experts.route_weights) gathers the very same softmax."""
        ids, weights = moe_experts.route(x, weight, top_k, renormalize, product=self.linear)
        moe_experts.record(record, slots, ids)
        return ids, weights

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        why = cuda_moe.experts_blocker(x, ids, weights, gate_up, down, grouped_only=True)
        if why:
            raise ValueError(f"batch-invariant mixture-of-experts: {why} (see CudaInvariantOps.check_model)")
        return cuda_moe.invariant_experts(self.kernels, x, ids, weights, gate_up, down)

    # ---- the sampler's normaliser ------------------------------------------------------------------

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        if x.shape[0] == 0:
            return x.new_empty(0)
        return torch.cat([self.kernels.argmax_logsumexp(x[i:i + MAX_ROWS])[2]
                          for i in range(0, x.shape[0], MAX_ROWS)])

    # ---- attention: one kernel layout, one query at a time -----------------------------------------

    def rope_and_write_kv(self, q, k, v, positions, cos_sin, kv_layer, slot_mapping) -> torch.Tensor:
        # the separate kernels, as the learner's forward calls them (causal_self_attention)
        q, k = self.rope(q, k, positions, cos_sin)
        self.write_kv(kv_layer, k, v, slot_mapping)
        return q

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata,
                  scale: float) -> torch.Tensor:
        if not self._attention_ok(q, kv_layer, meta):
            raise ValueError(f"batch-invariant attention: unsupported input q{tuple(q.shape)} {q.dtype}, "
                             f"kv{tuple(kv_layer.shape)} {kv_layer.dtype} (see CudaInvariantOps.check_model)")
        if meta.is_prefill:
            kv_indptr, kv_indices, last_len = self._per_query(meta, kv_layer.shape[3])
        else:
            kv_indptr, kv_indices, last_len = meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len
        return self.kernels.decode_attention(q, kv_layer, kv_indptr, kv_indices, last_len, scale,
                                             meta.max_kv_len, DECODE_LAYOUT)

    def _per_query(self, meta: attention_ref.AttentionMetadata, page_size: int) -> tuple[torch.Tensor, ...]:
        # built once per forward: every layer shares the metadata
        if self._expanded is None or self._expanded[0] is not meta:
            self._expanded = (meta, per_query_pages(meta, page_size))
        return self._expanded[1]

    # ---- the learner's forward (rollout_service.training.InvariantForward) --------------------------

    def causal_self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                              lens: list[int], scale: float) -> torch.Tensor:
        """RoPE then causal attention of sequences laid back to back (q [T, Hq, D], k / v [T, Hk, D], not yet
        rotated) with the engine's kernels: K/V written to scratch pages, each query through the decode kernel."""
        q, k = q.clone(), k.clone()  # the kernels rotate in place
        meta, num_pages = self._scratch_pages(lens, q.device)
        kv_layer = k.new_zeros(num_pages, 2, k.shape[1], PAGE_SIZE, k.shape[2])
        q = self.rope_and_write_kv(q, k, v, meta.positions, cos_sin, kv_layer, meta.slot_mapping)
        return self.attention(q, kv_layer, meta, scale)

    def _scratch_pages(self, lens: list[int], device: torch.device) -> tuple[attention_ref.AttentionMetadata, int]:
        """Prefill metadata of sequences `lens` on consecutive scratch pages (page 0 unused, as in the engine's
        pool) and the page count; kept while the lengths repeat, so every layer of a forward shares it (and the
        per-query expansion of _per_query)."""
        key = (tuple(lens), device)
        if self._scratch is None or self._scratch[0] != key:
            page_tables, first = [], 1
            for n in lens:
                pages = -(-n // PAGE_SIZE)
                page_tables.append(list(range(first, first + pages)))
                first += pages
            meta = attention_ref.make_metadata(page_tables, lens, lens, PAGE_SIZE, True, device)
            self._scratch = (key, meta, first)
        return self._scratch[1], self._scratch[2]
