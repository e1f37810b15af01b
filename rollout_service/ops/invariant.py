"""Batch-invariant ops: a token's numbers depend on its own sequence only, never on its batch mates.

Where an ordinary forward is not batch invariant: a GEMM's kernel (and with it the summation order of each
output) is chosen by the shape, so the same row gets other roundings at M = 1 than at M = 64 (on this CPU
build, rows of M = 1, 2, 3, 5, 7 take other paths than M = 4, 8 or any multiple of 16), and attention over a
batch padded to its longest sequence reduces over a length that the batch mates decide. Here:

- every matrix product has its rows zero-padded to a multiple of ROW_TILE, which keeps the GEMM library off its
  small-M paths, and runs as one product where that gives each row the bits of a ROW_TILE-row product of it
  (checked once per shape on 16 to 1024 random rows, `_fold_ok`), else as one ROW_TILE-row product per tile:
  the same reduction order for every row, whatever the batch, the step (prefill or decode) or the row's place;
- attention reduces over each query's keys in fixed blocks of KEY_BLOCK absolute positions (the exact maximum
  over all of them, then per-block sums added in block order), with products of tiles of a fixed row count
  (queries x the GQA group's heads), so prefill, decode and a recompute after preemption give a query the same
  bits; a sequence's tiles go in one product over its keys where that gives each row a tile product's bits
  (checked once per shape, `_attention_fold_ok`).

The sampler's normaliser is a row-tile product too (logsumexp: torch splits a lone row's sum across threads).
Mixture-of-experts layers put the router's and each expert's products on row tiles (an expert's GEMM has as
many rows as the batch routes to it); the softmax over the experts, the top-k and the weighted sum (explicit
adds in slot order, ops/moe_experts.py) are row-local. On the CPU in float32, attention is the C kernel's
(ops/cpu_attention.py): each query token is a row of its own there, summed over key blocks in key order. Norms
(rows of at most a few thousand), RoPE and SiLU are row-local already (tests/test_batch_invariant.py and
tests/test_moe_invariant.py check the whole engine).
The learner's recompute (rollout_service.training.InvariantForward) calls the same ops in its forward and
differentiates the plain torch reference math. The CUDA version is ops/invariant_cuda.py.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch

from rollout_service.ops import attention as attention_ref
from rollout_service.ops import cpu_attention, cpu_ext, cpu_linear, moe_experts
from rollout_service.ops.cpu_ops import CpuOps

ROW_TILE = 16
KEY_BLOCK = 64


def _row_tiles(x: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """x [M, ...] zero-padded to a multiple of `tile` rows and viewed as [M / tile, tile, ...]."""
    rows = x.shape[0]
    tiles = -(-rows // tile)
    if tiles * tile != rows:
        x = torch.cat([x, x.new_zeros(tiles * tile - rows, *x.shape[1:])])
    return x.view(tiles, tile, *x.shape[1:])


_FOLD_CHECK_ROWS = (ROW_TILE, 3 * ROW_TILE, 16 * ROW_TILE, 64 * ROW_TILE)
_fold_checked: dict[tuple, bool] = {}
Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [M, K], weight [N, K]) -> x @ weight.T


def matmul_t(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through torch.matmul (the BLAS's GEMM)."""
    return x @ weight.t()


def _fold_ok(weight: torch.Tensor, product: Product = matmul_t) -> bool:
    """Whether one `product` of many ROW_TILE-multiple rows with weight's shape gives every row the bits that a
    ROW_TILE-row product gives it: a GEMM library picks its kernel (and summation order) by shape, not data, so
    random rows answer for all rows. Measured once per product, shape, dtype and device."""
    key = (product, tuple(weight.shape), weight.dtype, weight.device.type)
    if key not in _fold_checked:
        # normal tensors, as the model's weights are (an inference tensor would take another product)
        with torch.inference_mode(False), torch.no_grad():
            g = torch.Generator().manual_seed(0)
            x = torch.randn(_FOLD_CHECK_ROWS[-1], weight.shape[1], generator=g).to(weight.device, weight.dtype)
            w = torch.randn(weight.shape, generator=g).to(weight.device, weight.dtype)
            tiles = torch.cat([product(x[i:i + ROW_TILE], w) for i in range(0, x.shape[0], ROW_TILE)])
            _fold_checked[key] = all(torch.equal(product(x[:m], w), tiles[:m]) for m in _FOLD_CHECK_ROWS)
    return _fold_checked[key]


def tiled_product(x: torch.Tensor, weight: torch.Tensor, product: Product = matmul_t) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T with the bits of [ROW_TILE, K] tile products (rows past M dropped)."""
    rows, tiles = x.shape[0], _row_tiles(x)
    if _fold_ok(weight, product):
        out = product(tiles.view(-1, x.shape[1]), weight)  # one product of all the tiles' rows
    else:
        out = torch.cat([product(tile, weight) for tile in tiles])
    return out[:rows]


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[B] log-sum-exp of the rows of x [B, V], the sum of exp(x - max) taken as a product with a ones vector
    on row tiles: torch's own reduction splits a lone row across threads and sums it in another order than
    the same row inside a batch. Same special values as torch (a NaN gives NaN, else +inf gives +inf, an all
    -inf row -inf); differentiable (the shift is a constant, as usual)."""
    m = x.amax(dim=1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = tiled_product(torch.exp(x - shift), x.new_ones(1, x.shape[1]))
    return (torch.log(total) + shift)[:, 0]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) on row tiles: oneDNN's products with the packed weight where they apply (float32 on
    the CPU, ops/cpu_linear.py), the BLAS's GEMM elsewhere. The engine's forward and the learner's recompute take
    the same one: both call this with float32 weights that are not inference tensors, outside autograd."""
    flat = x.reshape(-1, x.shape[-1])
    out = tiled_product(flat, weight, cpu_linear.linear if cpu_linear.applies(flat, weight) else matmul_t)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 logits (the reference's rule: half inputs multiply exactly in float32) on row tiles."""
    return linear(hidden.float(), weight.float())


class _Layout(NamedTuple):
    """Where each query row of a step sits in attention's tiles: sequence b's queries fill slots [b, 0:n_b] of
    [B, S * per_tile] (S: the most tiles a sequence needs; a padding slot repeats the sequence's last query)."""
    rows: torch.Tensor  # [B, S * per_tile] index into the flat query rows
    real: torch.Tensor  # [B, S * per_tile] bool: a query of the sequence, not padding
    pos: torch.Tensor  # [B, S * per_tile] the slot's absolute position
    limit: torch.Tensor  # [B] the sequence's key count
    tiles: int  # S
    used: int  # tiles holding a query (B * S when every sequence needs S)


_layouts: dict[tuple, _Layout] = {}


def _layout(q_lens: list[int], kv_lens: list[int], per_tile: int, device: torch.device) -> _Layout:
    """The step's tile layout, built once for all its layers (the last few steps' kept)."""
    key = (tuple(q_lens), tuple(kv_lens), per_tile, str(device))
    if key not in _layouts:
        if len(_layouts) >= 8:
            _layouts.pop(next(iter(_layouts)))
        n = torch.tensor(q_lens, device=device)
        kv = torch.tensor(kv_lens, device=device)
        per_seq = [-(-x // per_tile) for x in q_lens]
        tiles = max(1, max(per_seq))
        slot = torch.arange(tiles * per_tile, device=device)[None, :]
        last = (n - 1).clamp(min=0)[:, None]
        start = torch.cumsum(n, 0)[:, None] - n[:, None]
        _layouts[key] = _Layout(rows=(start + slot.minimum(last)).clamp(min=0), real=slot < n[:, None],
                                pos=(kv - n)[:, None] + slot.minimum(last), limit=kv, tiles=tiles,
                                used=sum(per_seq))
    return _layouts[key]


def _scores(tiles: torch.Tensor, keys: torch.Tensor, wide: bool) -> torch.Tensor:
    """tiles [N, Hk, M, D] x keys [N, Hk, L, D] transposed: [N, Hk, M, L], by definition one product per key
    block; `wide`: one product over all the blocks (where the check showed the same bits)."""
    if wide:
        return torch.matmul(tiles, keys.transpose(-1, -2))
    return torch.cat([torch.matmul(tiles, keys[:, :, j:j + KEY_BLOCK].transpose(-1, -2))
                      for j in range(0, keys.shape[2], KEY_BLOCK)], -1)


def _block_products(p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[N, Hk, L / KEY_BLOCK, M, D]: each key block's weights p [N, Hk, M, L] times its values [N, Hk, L, D]."""
    n, hk, m, length = p.shape
    blocks = length // KEY_BLOCK
    return torch.matmul(p.view(n, hk, m, blocks, KEY_BLOCK).transpose(2, 3),
                        values.view(n, hk, blocks, KEY_BLOCK, -1))


_attention_fold_checked: dict[tuple, bool] = {}


def _attention_fold_ok(rows: int, head_dim: int, device: torch.device) -> bool:
    """Whether attention's products give a row the bits of R-row tile products per key block when a sequence's
    tiles are stacked into one product of k * R rows (k = 1, 2, 3, 16, 64: attention stacks at most 64) and the
    scores span 1, 3 or 16 key blocks (trusted for longer spans), batched as attention batches them. Then a
    sequence's keys are read in place, not copied per tile, and the scores are one product. Checked once per
    shape on random data: a BLAS picks its kernel by shape, not data."""
    key = (rows, head_dim, device.type)
    if key not in _attention_fold_checked:
        g = torch.Generator().manual_seed(0)
        x, keys, values = (torch.randn(3, 2, n, head_dim, generator=g).to(device)
                           for n in (64 * rows, 16 * KEY_BLOCK, 16 * KEY_BLOCK))
        p = torch.rand(3, 2, 64 * rows, 16 * KEY_BLOCK, generator=g).to(device)
        tile_rows = range(0, 64 * rows, rows)
        scores = torch.cat([_scores(x[:, :, i:i + rows], keys, False) for i in tile_rows], 2)
        parts = torch.cat([_block_products(p[:, :, i:i + rows], values) for i in tile_rows], 3)
        _attention_fold_checked[key] = all(
            torch.equal(_scores(x[:b, :, :m * rows], keys[:b, :, :n * KEY_BLOCK], True),
                        scores[:b, :, :m * rows, :n * KEY_BLOCK]) and
            torch.equal(_block_products(p[:b, :, :m * rows, :n * KEY_BLOCK], values[:b, :, :n * KEY_BLOCK]),
                        parts[:b, :, :n, :m * rows])
            for m in (1, 2, 3, 16, 64) for n in (1, 3, 16) for b in (1, 3))
    return _attention_fold_checked[key]


def _queries_per_tile(group: int, head_dim: int, device: torch.device) -> tuple[int, bool]:
    """(queries per tile, whether a sequence's tiles stack): the fewest queries whose rows (x the G heads) make a
    tile that stacks, as a decode query is padded to a whole tile; else ROW_TILE // G, one product per tile."""
    most = max(1, ROW_TILE // group)
    for queries in range(1, most + 1):
        if _attention_fold_ok(queries * group, head_dim, device):
            return queries, True
    return most, False


def block_attention_forward(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_lens: list[int],
                            kv_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (sequence b's rows are its last q_lens[b] positions) over each
    sequence's keys / values [B, Hk, L, D] (anything, even NaN, past kv_lens[b]: masked here, and values zeroed
    there in place: pass a copy); float32.

    A tile is a fixed number of queries of one sequence times the G query heads of a kv head (GQA), its rows
    in a fixed order. Its numbers are those of products of one fixed shape per key block [j * KEY_BLOCK,
    (j + 1) * KEY_BLOCK) ([R, D] x [D, KEY_BLOCK] scores, [R, KEY_BLOCK] x [KEY_BLOCK, D] weighted values), or,
    where a check shows the same bits (`_attention_fold_ok`), of a sequence's tiles stacked into one product over
    all its keys, read in place; then a tile is the fewest queries that stack (a decode query pads to a tile),
    else ROW_TILE // G queries. The softmax takes the exact maximum over the visible keys, sums each block's
    weights and weighted values, and adds the blocks in order: a block wholly after a query's position adds
    exact zeros, so neither tile mates nor the number of blocks change a query's numbers. Masks are skipped
    where nothing is masked (an all-false mask changes no bit)."""
    num_q, num_q_heads, head_dim = q.shape
    batch, num_kv_heads, length = keys.shape[:3]
    group = num_q_heads // num_kv_heads
    per_tile, stackable = _queries_per_tile(group, head_dim, q.device)
    if num_q == 0:
        return q.new_zeros(q.shape, dtype=torch.float32)
    lay = _layout(q_lens, kv_lens, per_tile, q.device)
    width = lay.tiles * per_tile * group  # a sequence's rows: its tiles one after another
    span = -(-max(kv_lens) // KEY_BLOCK) * KEY_BLOCK  # whole blocks (zeros past L: masked)
    keys, values = (torch.nn.functional.pad(t, (0, 0, 0, span - length)) if length < span else t[:, :, :span]
                    for t in (keys, values))
    # [B, Hk, S * per_tile * G, D]: slot-major, then the group's heads
    tiles = (q.float()[lay.rows].view(batch, -1, num_kv_heads, group, head_dim)
             .permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, width, head_dim))
    pos = lay.pos[:, None, :, None].expand(-1, 1, -1, group).reshape(batch, 1, width)
    live = [(kv, n) for kv, n in zip(kv_lens, q_lens) if n > 0]
    _zero_past_ends(values, lay.limit, min(kv for kv, _ in live))
    attend = partial(_attend, scale=scale, wide=stackable, masked=span > min(kv - n for kv, n in live) + 1)
    if lay.tiles == 1 or (stackable and lay.tiles * batch <= 2 * lay.used):
        # at most 64 tiles a product (what the check covers), fewer where the scores would not fit
        tile_rows = per_tile * group
        step = max(1, min(64, _CHUNK_FLOATS // (batch * num_kv_heads * span * tile_rows))) * tile_rows
        out = torch.cat([attend(tiles[:, :, r:r + step], keys, values, pos[:, :, r:r + step], lay.limit)
                         for r in range(0, width, step)], 2)
    else:
        out = _attend_per_tile(tiles, keys, values, pos, lay, attend)
    out = out.view(batch, num_kv_heads, -1, group, head_dim).permute(0, 2, 1, 3, 4)
    return out.reshape(-1, num_q_heads, head_dim)[lay.real.flatten()]  # [T, Hq, D] in token order


_CHUNK_FLOATS = 1 << 24  # scores (or a per-tile path's copied keys) held at once


def _attend_per_tile(tiles: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                     lay: _Layout, attend: Callable) -> torch.Tensor:
    """One product per tile (no stacking, or ragged lengths where stacking would mostly compute padding), each
    tile with its own copy of its sequence's keys; back in [B, Hk, S * R, D] order, dropped tiles zeros."""
    batch, num_kv_heads, width, head_dim = tiles.shape
    keep = lay.real.view(batch, lay.tiles, -1).any(-1).flatten()
    tile_seq = torch.arange(batch, device=tiles.device).repeat_interleave(lay.tiles)[keep]
    tiles = tiles.view(batch, num_kv_heads, lay.tiles, -1, head_dim).transpose(1, 2).flatten(0, 1)[keep]
    pos = pos.view(batch, 1, lay.tiles, -1).transpose(1, 2).flatten(0, 1)[keep]
    step = max(1, _CHUNK_FLOATS // (num_kv_heads * keys.shape[2] * max(head_dim, tiles.shape[2])))
    parts = []
    for t in range(0, tiles.shape[0], step):
        seq = tile_seq[t:t + step]
        parts.append(attend(tiles[t:t + step], keys[seq], values[seq], pos[t:t + step], lay.limit[seq]))
    full = tiles.new_zeros(batch * lay.tiles, *tiles.shape[1:])
    full[keep] = torch.cat(parts)
    return full.view(batch, lay.tiles, num_kv_heads, -1, head_dim).transpose(1, 2).reshape(
        batch, num_kv_heads, width, head_dim)


def _zero_past_ends(values: torch.Tensor, limit: torch.Tensor, shortest: int) -> None:
    """Zero values [B, Hk, L, D] past each sequence's end, in place (the caller's own copy; only the blocks
    from the shortest sequence's end on): their weights are exactly 0, and 0 * garbage (even NaN) must stay 0."""
    start = shortest // KEY_BLOCK * KEY_BLOCK
    if start < values.shape[2]:
        key_pos = torch.arange(start, values.shape[2], device=values.device)
        values[:, :, start:].masked_fill_((key_pos >= limit[:, None])[:, None, :, None], 0.0)


def _attend(tiles: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, limit: torch.Tensor,
            scale: float, wide: bool, masked: bool) -> torch.Tensor:
    """Softmax attention of rows tiles [N, Hk, M, D] (at positions pos [N, 1, M]) over keys / values
    [N, Hk, L, D] (L whole blocks, limit [N] real, values zero past it): [N, Hk, M, D]. masked: whether some
    row may not see some key."""
    scores = _scores(tiles, keys, wide) * scale
    if masked:
        key_pos = torch.arange(keys.shape[2], device=keys.device)
        visible = (key_pos <= pos[..., None]) & (key_pos < limit[:, None, None, None])
        scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1, keepdim=True)  # exact, in any order
    p = torch.exp(scores - torch.where(top == float("-inf"), torch.zeros_like(top), top))
    sums = p.view(*p.shape[:3], -1, KEY_BLOCK).sum(-1)  # [N, Hk, M, blocks]
    parts = _block_products(p, values)  # [N, Hk, blocks, M, D]
    denom, acc = sums[..., 0], parts[:, :, 0]
    for j in range(1, sums.shape[-1]):  # blocks in order
        denom, acc = denom + sums[..., j], acc + parts[:, :, j]
    return acc / denom[..., None]


def padded_per_sequence(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """x [T, H, D] (sequences back to back) as float32 [B, H, max(lens), D], zero past each length."""
    out = x.new_zeros(len(lens), x.shape[1], max(lens), x.shape[2], dtype=torch.float32)
    start = 0
    for b, n in enumerate(lens):
        out[b, :, :n] = x[start:start + n].transpose(0, 1).float()
        start += n
    return out


def gather_paged_kv(kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """Each sequence's K and V [B, Hk, L, D] in float32 from the paged cache, L whole KEY_BLOCKs (what lies past
    a sequence's length, stale page tails and padding pages, is masked by block_attention_forward). Gathered
    per (page, kv head), which lands them in [B, Hk, L, D] order in one copy."""
    tables = meta.block_tables
    max_pages, per_block = tables.shape[1], max(1, KEY_BLOCK // kv_layer.shape[3])
    if max_pages % per_block:  # the reserved page 0 as padding: whole blocks without a second copy
        tables = torch.nn.functional.pad(tables, (0, per_block - max_pages % per_block))
    keys, values = attention_ref.gather_pages_by_head(kv_layer, tables)
    return keys.float(), values.float()


class InvariantOps(CpuOps):
    """The torch reference with batch-invariant products and attention (EngineConfig.batch_invariant)."""

    name = "torch-invariant"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, weight, bias)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return logits(hidden, weight)

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The row-tile product, then silu_and_mul: as the learner's recompute takes them."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        return logsumexp(x)

    def argmax_logsumexp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """With this class's normaliser: the learner's recompute takes it for every token."""
        values, tokens = x.max(dim=1)
        return tokens, values, self.logsumexp(x)

    def moe_route(self, x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                  record: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logits on row tiles; softmax and top-k are row-local."""
        ids, weights = moe_experts.route(x, weight, top_k, renormalize, product=linear)
        moe_experts.record(record, slots, ids)
        return ids, weights

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        """Each expert's rows on row tiles: a row's bits do not depend on how many rows its expert got."""
        return moe_experts.experts(x, ids, weights, gate_up, down, product=linear)

    def attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention_ref.AttentionMetadata, scale: float
    ) -> torch.Tensor:
        if cpu_attention.applies(q, kv_layer):  # row-local by construction (csrc/cpu_attention.c), and faster
            return cpu_attention.attention(q, kv_layer, meta, scale)
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
        if cpu_ext.takes(q, k):  # the engine's attention here (cpu_attention.applies to its cache)
            return cpu_attention.causal(q, k, v, lens, scale)
        keys, values = padded_per_sequence(k, lens), padded_per_sequence(v, lens)
        return block_attention_forward(q, keys, values, lens, lens, scale).to(q.dtype)
