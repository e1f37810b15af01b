"""Batch-invariant ops: a token's numbers depend on its own sequence only, never on its batch mates.

Where an ordinary forward is not batch invariant: a GEMM's kernel (and with it the summation order of each
output) is chosen by the shape, so the same row gets other roundings at M = 1 than at M = 64 (on this CPU
build, rows of M < 4 take a GEMV path), and attention over a batch padded to its longest sequence reduces
over a length that the batch mates decide. Here:

- every matrix product runs on fixed-size row tiles (ROW_TILE rows, zero-padded): the same kernel with the
  same reduction order for every row, whatever the batch, the step (prefill or decode) or the row's place;
- attention walks each query's keys in fixed blocks of KEY_BLOCK absolute positions with an online softmax
  merged in block order, so prefill, decode and a recompute after preemption give a query the same bits.

The sampler's normaliser is a row-tile product too (logsumexp: torch splits a lone row's sum across threads).
Norms (rows of at most a few thousand), RoPE and SiLU are row-local already (tests/test_batch_invariant.py checks
the whole engine). The learner's recompute (rollout_service.training.InvariantForward) calls the same ops in
its forward and differentiates the plain torch reference math. The CUDA version is ops/invariant_cuda.py.
"""
from __future__ import annotations

import torch

from rollout_service.ops import attention as attention_ref
from rollout_service.ops.torch_ops import TorchOps

ROW_TILE = 16
KEY_BLOCK = 64


def _row_tiles(x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """x [M, ...] zero-padded to a multiple of `tile` rows and viewed as [M / tile, tile, ...]."""
    rows = x.shape[0]
    tiles = -(-rows // tile)
    if tiles * tile != rows:
        x = torch.cat([x, x.new_zeros(tiles * tile - rows, *x.shape[1:])])
    return x.view(tiles, tile, *x.shape[1:])


def tiled_matmul(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] as one batched product of [ROW_TILE, K] tiles (rows past M dropped)."""
    rows = x.shape[0]
    out = torch.matmul(_row_tiles(x), weight_t)
    return out.reshape(-1, weight_t.shape[1])[:rows]


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[B] log-sum-exp of the rows of x [B, V], the sum of exp(x - max) taken as a product with a ones vector
    on row tiles: torch's own reduction splits a lone row across threads and sums it in another order than
    the same row inside a batch. Same special values as torch (a NaN gives NaN, else +inf gives +inf, an all
    -inf row -inf); differentiable (the shift is a constant, as usual)."""
    m = x.amax(dim=1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = tiled_matmul(torch.exp(x - shift), x.new_ones(x.shape[1], 1))
    return (torch.log(total) + shift)[:, 0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) on row tiles."""
    flat = x.reshape(-1, x.shape[-1])
    out = tiled_matmul(flat, weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 logits (the reference's rule: half inputs multiply exactly in float32) on row tiles."""
    return linear(hidden.float(), weight.float())


def _query_tiles(q_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's query rows cut into ROW_TILE-row tiles of their own: (token index [NT, R] into the
    flat query rows, padding rows repeating the sequence's last query; the tile's sequence [NT]; real [NT, R])."""
    rows, seqs, real = [], [], []
    start = 0
    for b, n in enumerate(q_lens):
        for t0 in range(0, n, ROW_TILE):
            idx = torch.arange(start + t0, start + t0 + ROW_TILE)
            real.append(idx < start + n)
            rows.append(idx.clamp(max=start + n - 1))
            seqs.append(b)
        start += n
    if not rows:
        empty = torch.empty(0, ROW_TILE, dtype=torch.long, device=device)
        return empty, torch.empty(0, dtype=torch.long, device=device), empty.bool()
    return (torch.stack(rows).to(device), torch.tensor(seqs, device=device), torch.stack(real).to(device))


def block_attention_forward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_lens: list[int],
                            kv_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (sequence b's rows are its last q_lens[b] positions) over each
    sequence's keys / values [B, Hk, L, D] (anything, even NaN, past kv_lens[b]: masked here); float32.

    A tile (ROW_TILE queries of one sequence and head) walks key blocks [j * KEY_BLOCK, (j + 1) * KEY_BLOCK)
    with products of fixed shape ([R, D] x [D, KEY_BLOCK], [R, KEY_BLOCK] x [KEY_BLOCK, D]). A block wholly
    after a query's position leaves its state bit for bit unchanged (scores -inf, weights exactly 0, the
    rescale exp(0) = 1), so neither tile mates nor the number of blocks change a query's numbers."""
    num_q, num_q_heads, head_dim = q.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    dev = q.device
    rows, tile_seq, real = _query_tiles(q_lens, dev)
    if rows.shape[0] == 0:
        return q.new_zeros(q.shape, dtype=torch.float32)
    first_pos = torch.tensor([kv - n for kv, n in zip(kv_lens, q_lens)], device=dev)
    q_start = torch.tensor([0] + q_lens, device=dev).cumsum(0)[:-1]
    pos = first_pos[tile_seq][:, None] + rows - q_start[tile_seq][:, None]  # [NT, R]
    limit = torch.tensor(kv_lens, device=dev)[tile_seq]  # [NT]
    tiles = q.float()[rows].permute(2, 0, 1, 3)  # [Hq, NT, R, D]
    kv_head = torch.arange(num_q_heads, device=dev) // (num_q_heads // num_kv_heads)
    n_tiles = rows.shape[0]
    m = torch.full((num_q_heads, n_tiles, ROW_TILE), float("-inf"), device=dev)
    denom = torch.zeros(num_q_heads, n_tiles, ROW_TILE, device=dev)
    acc = torch.zeros(num_q_heads, n_tiles, ROW_TILE, head_dim, device=dev)
    for j in range(-(-max(kv_lens) // KEY_BLOCK)):
        key_pos = torch.arange(j * KEY_BLOCK, (j + 1) * KEY_BLOCK, device=dev)
        in_cache = key_pos.clamp(max=length - 1)
        sel = (tile_seq[None, :, None], kv_head[:, None, None], in_cache[None, None, :])
        kb, vb = keys[sel], values[sel]  # [Hq, NT, KB, D]
        in_seq = key_pos[None, :] < limit[:, None]  # [NT, KB]
        visible = (key_pos[None, None, :] <= pos[..., None]) & in_seq[:, None, :]
        vb = vb.masked_fill(~in_seq[None, :, :, None], 0.0)  # 0 * garbage stays 0
        scores = torch.matmul(tiles, kb.transpose(-1, -2)) * scale  # [Hq, NT, R, KB]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        m_use = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        corr = torch.exp(m - m_use)
        p = torch.exp(scores - m_use[..., None])
        denom = denom * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.matmul(p, vb)
        m = m_new
    out = (acc / denom[..., None]).permute(1, 2, 0, 3)[real]  # [T, Hq, D] in tile order = token order
    return out


def padded_per_sequence(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """x [T, H, D] (sequences back to back) as float32 [B, H, max(lens), D], zero past each length."""
    out = x.new_zeros(len(lens), x.shape[1], max(lens), x.shape[2], dtype=torch.float32)
    start = 0
    for b, n in enumerate(lens):
        out[b, :, :n] = x[start:start + n].transpose(0, 1).float()
        start += n
    return out


def gather_paged_kv(kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """Each sequence's K and V [B, Hk, L, D] in float32 from the paged cache (L: the batch's page span; what
    lies past a sequence's length, stale page tails and padding pages, is masked by block_attention_forward)."""
    _, _, num_kv_heads, page_size, head_dim = kv_layer.shape
    batch, max_pages = meta.block_tables.shape
    kv = kv_layer[meta.block_tables.long()]  # [B, P, 2, Hk, ps, D]
    kv = kv.permute(2, 0, 3, 1, 4, 5).reshape(2, batch, num_kv_heads, max_pages * page_size, head_dim).float()
    return kv[0], kv[1]


class InvariantOps(TorchOps):
    """The torch reference with batch-invariant products and attention (EngineConfig.batch_invariant)."""

    name = "torch-invariant"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, weight, bias)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return logits(hidden, weight)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        return logsumexp(x)

    def attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata, scale: float
    ) -> torch.Tensor:
        keys, values = gather_paged_kv(kv_layer, meta)
        q_lens = (meta.qo_indptr[1:] - meta.qo_indptr[:-1]).tolist()
        out = block_attention_forward(q, keys, values, q_lens, meta.kv_lens.tolist(), scale)
        return out.to(q.dtype)

    def causal_self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                              lens: list[int], scale: float) -> torch.Tensor:
        """RoPE then causal attention of sequences laid back to back (q [T, Hq, D], k / v [T, Hk, D], not yet
        rotated), as the engine computes them: the learner's forward (rollout_service.training.InvariantForward)."""
        positions = torch.cat([torch.arange(n, device=q.device) for n in lens])
        q, k = self.rope(q, k, positions, cos_sin)
        keys, values = padded_per_sequence(k, lens), padded_per_sequence(v, lens)
        return block_attention_forward(q, keys, values, lens, lens, scale).to(q.dtype)
