"""Logits processors: repetition/frequency/presence penalties and top-k/top-p/min-p truncation.

All functions are vectorised over the batch; Python loops only run over sequences to build index lists.

Penalties (applied to the raw logits, in this order, as in vLLM):
  repetition_penalty p: for every token present in prompt + output, logit / p if logit > 0 else logit * p
  frequency_penalty f:  logit -= f * (count of the token in the output)
  presence_penalty r:   logit -= r if the token occurs in the output
Truncation (applied to the temperature-scaled logits; dropped tokens get -inf, HF order):
  top_k k (-1 = off):   keep the k highest
  top_p q (1 = off):    on the distribution renormalised over what top_k kept, keep the smallest set of
                        highest tokens whose cumulative probability reaches q (the top token always stays)
  min_p m (0 = off):    drop tokens with prob < m * (max prob); the ratio is unchanged by renormalisation,
                        so this is logit < max_logit + log(m) and commutes with top_k / top_p.
"""
from __future__ import annotations

import torch

PREFILTER = 1024  # candidates looked at before falling back to a full sort for top_p

def _padded(token_lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """int64 [R, L] with each row padded by `pad` (L >= 1 so scatter always has a column)."""
    width = max(1, max(len(t) for t in token_lists))
    rows = [t + [pad] * (width - len(t)) for t in token_lists]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """float32 [R, V]: how often each vocab id occurs in each row's list (scatter_add, padding in column V)."""
    for t in token_lists:
        if t and (min(t) < 0 or max(t) >= vocab_size):
            raise ValueError(f"token id {max(t) if max(t) >= vocab_size else min(t)} is outside the "
                             f"vocabulary of the logits (size {vocab_size})")
    tokens = _padded(token_lists, vocab_size, device)
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
                    repetition: list[float], frequency: list[float], presence: list[float]) -> torch.Tensor:
    """Penalised copy of logits [B, V]; rows whose three penalties are neutral are returned unchanged."""
    rows = [i for i in range(len(outputs))
            if repetition[i] != 1.0 or frequency[i] != 0.0 or presence[i] != 0.0]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    every = len(rows) == logits.shape[0]
    idx = None if every else torch.tensor(rows, device=dev)
    sub = logits if every else logits[idx]
    params = torch.tensor([[repetition[i], frequency[i], presence[i]] for i in rows], device=dev)
    rep, freq, pres = (params[:, j:j + 1] for j in range(3))

    counts = token_counts([outputs[i] for i in rows], vocab, dev)
    in_output = counts > 0
    if any(repetition[i] != 1.0 for i in rows):
        # only rows with a repetition penalty need their (possibly long) prompt scattered
        prompt_lists = [prompts[i] if repetition[i] != 1.0 else [] for i in rows]
        seen = in_output | (token_counts(prompt_lists, vocab, dev) > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * in_output.to(sub.dtype)
    if every:
        return sub
    out = logits.clone()
    out[idx] = sub
    return out


def truncation_mask(scaled: torch.Tensor, top_k: list[int], top_p: list[float],
                    min_p: list[float]) -> torch.Tensor:
    """bool [R, V], True = drop. One sort serves top_k and top_p; top_k alone uses topk."""
    dev, (num_rows, vocab) = scaled.device, scaled.shape
    k = torch.tensor([vocab if x == -1 else min(x, vocab) for x in top_k], device=dev)
    drop: torch.Tensor | None = None
    if any(p < 1.0 for p in top_p):
        drop = _top_k_top_p(scaled, k, torch.tensor(top_p, device=dev))
    elif any(x != -1 for x in top_k):
        drop = _top_k_only(scaled, k, torch.tensor([x != -1 for x in top_k], device=dev))
    if any(m > 0.0 for m in min_p):
        # log(0) = -inf, so rows with min_p == 0 drop nothing
        log_m = torch.tensor(min_p, dtype=scaled.dtype, device=dev).log().unsqueeze(1)
        low = scaled < scaled.amax(dim=1, keepdim=True) + log_m
        drop = low if drop is None else drop | low
    if drop is None:
        drop = torch.zeros(num_rows, vocab, dtype=torch.bool, device=dev)
    return drop


def _top_k_top_p(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_k then top_p. A full sort of a 150k vocabulary is the costly part, so first try the
    PREFILTER best tokens: a row whose kept set provably lies inside them needs no full sort."""
    vocab = scaled.shape[1]
    if vocab <= 2 * PREFILTER:
        values, order = scaled.sort(dim=1, descending=True)
        return _scatter_back(_sorted_drop(values, k, top_p, None), order)
    values, order = scaled.topk(PREFILTER, dim=1)
    # normalise over the whole row (top_k off) or over the top k (k <= PREFILTER): both are known here
    lse = torch.where(k >= vocab, scaled.logsumexp(dim=1), _masked(values, k).logsumexp(dim=1))
    drop_sorted, mass = _sorted_drop(values, k, top_p, lse)
    covered = (k <= PREFILTER) | ((k >= vocab) & (mass >= top_p))
    drop = torch.ones_like(scaled, dtype=torch.bool).scatter_(1, order, drop_sorted)
    if not bool(covered.all()):
        rest = torch.nonzero(~covered).squeeze(1)
        values, order = scaled[rest].sort(dim=1, descending=True)
        drop[rest] = _scatter_back(_sorted_drop(values, k[rest], top_p[rest], None), order)
    return drop


def _masked(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    rank = torch.arange(values.shape[1], device=values.device)
    return values.masked_fill(rank.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))


def _sorted_drop(values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor | None):
    """Drop mask over descending `values` (a full row, or its head when lse, the row's log-normaliser,
    is given; then also returns the probability mass of the head)."""
    masked = _masked(values, k)
    probs = masked.softmax(dim=1) if lse is None else (masked - lse.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=1)
    # mass strictly before each token: the first token has 0 < top_p, so it is always kept
    drop = torch.isneginf(masked) | (cum - probs >= top_p.unsqueeze(1))
    return drop if lse is None else (drop, cum[:, -1])


def _scatter_back(drop_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)


def _top_k_only(scaled: torch.Tensor, k: torch.Tensor, has_k: torch.Tensor) -> torch.Tensor:
    k_max = int(k[has_k].max())
    _, order = scaled.topk(k_max, dim=1)
    keep_sorted = torch.arange(k_max, device=scaled.device).unsqueeze(0) < k.unsqueeze(1)
    drop = torch.ones_like(scaled, dtype=torch.bool).scatter_(1, order, ~keep_sorted)
    return drop & has_k.unsqueeze(1)
