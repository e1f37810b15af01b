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
Ties: every rule keeps the tokens whose logit equals that of the last token it keeps (so with ties at
the boundary slightly more than k tokens, or than the minimal top_p set, survive). This makes the masks
a function of the logit values alone, whatever order a sort gives equal values (bf16 logits tie often).
"""
from __future__ import annotations

import numpy as np
import torch

from rollout_service.engine.transfers import to_device

PREFILTER = 1024  # candidates looked at before falling back to a full sort for top_p


def _padded(token_lists: list[list[int]], vocab_size: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [R, L] token ids, bool [R, L] real-entry mask). Each row is padded with its own first
    token (0 if empty), so an idempotent scatter writes the same value at a pad as at that token."""
    width = max(1, max(len(t) for t in token_lists))
    ids = np.zeros((len(token_lists), width), dtype=np.int64)
    real = np.zeros((len(token_lists), width), dtype=bool)
    for i, t in enumerate(token_lists):  # numpy row copies: ~4x faster than building padded lists
        if t:
            if min(t) < 0 or max(t) >= vocab_size:
                bad = min(t) if min(t) < 0 else max(t)
                raise ValueError(f"token id {bad} is outside the vocabulary of the logits (size {vocab_size})")
            ids[i, :len(t)], ids[i, len(t):], real[i, :len(t)] = t, t[0], True
    return torch.from_numpy(ids).to(device), torch.from_numpy(real).to(device)


def apply_penalties(logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
                    repetition: list[float], frequency: list[float], presence: list[float]) -> torch.Tensor:
    """Penalised copy of logits [B, V] (logits itself when no row has a penalty).

    Sparse: only the [R, L] entries of the rows' own tokens are gathered, changed and scattered back;
    the dense work is one copy of the rows. Duplicated tokens are harmless: the idempotent steps write
    the same value for every copy, and the frequency step adds the same amount once per occurrence.
    """
    rows = [i for i in range(len(outputs))
            if repetition[i] != 1.0 or frequency[i] != 0.0 or presence[i] != 0.0]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    every = len(rows) == logits.shape[0]
    idx = None if every else torch.tensor(rows, device=dev)
    work = logits.clone() if every else logits[idx]
    # a row with no tokens to penalise gets neutral values, so its padding (token 0) stays untouched
    params = torch.tensor([[repetition[i] if prompts[i] or outputs[i] else 1.0,
                            frequency[i] if outputs[i] else 0.0,
                            presence[i] if outputs[i] else 0.0] for i in rows], device=dev)
    rep, freq, pres = (params[:, j:j + 1] for j in range(3))
    if any(repetition[i] != 1.0 for i in rows):
        seen, _ = _padded([prompts[i] + outputs[i] if repetition[i] != 1.0 else [] for i in rows], vocab, dev)
        x = work.gather(1, seen)
        work.scatter_(1, seen, torch.where(x > 0, x / rep, x * rep))
    if any(frequency[i] != 0.0 or presence[i] != 0.0 for i in rows):
        out, real = _padded([outputs[i] for i in rows], vocab, dev)
        work.scatter_(1, out, work.gather(1, out) - pres)                # once per distinct token
        work.scatter_add_(1, out, (-freq).expand_as(out) * real)          # once per occurrence
    if every:
        return work
    result = logits.clone()
    result[idx] = work
    return result


def truncation_mask(scaled: torch.Tensor, top_k: list[int], top_p: list[float],
                    min_p: list[float]) -> torch.Tensor:
    """bool [R, V], True = drop.

    Each rule yields a per-row threshold (keep a token iff its logit >= the threshold, so tokens tied
    with the last kept one are all kept: the result depends on the values only, never on how a sort
    orders ties). One sort serves top_k and top_p together; top_k alone needs only topk.
    """
    dev, vocab = scaled.device, scaled.shape[1]
    ks = [vocab if x == -1 else min(x, vocab) for x in top_k]
    k = to_device(ks, dev)
    threshold = torch.full((scaled.shape[0],), float("-inf"), device=dev)
    if any(p < 1.0 for p in top_p):
        threshold = _top_k_top_p_threshold(scaled, k, to_device(top_p, dev))
    elif any(x != -1 for x in top_k):
        threshold = _top_k_threshold(scaled, k, max((x for x in ks if x < vocab), default=vocab))
    if any(m > 0.0 for m in min_p):
        # prob < m * max prob  <=>  logit < max logit + log(m); log(0) = -inf keeps everything
        log_m = to_device(min_p, dev, scaled.dtype).log()
        threshold = torch.maximum(threshold, scaled.amax(dim=1) + log_m)
    return scaled < threshold.unsqueeze(1)


def _top_k_threshold(scaled: torch.Tensor, k: torch.Tensor, k_max: int) -> torch.Tensor:
    """The k-th largest logit of each row (-inf where top_k is off); k_max: the largest k that is on."""
    vocab = scaled.shape[1]
    values = scaled.topk(k_max, dim=1).values
    kth = values.gather(1, (k.clamp(max=k_max) - 1).unsqueeze(1)).squeeze(1)
    return torch.where(k < vocab, kth, torch.full_like(kth, float("-inf")))


def _top_k_top_p_threshold(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest kept logit under top_k then top_p. A full sort of a 150k vocabulary is the costly part,
    so first look at the PREFILTER best tokens: a row whose kept set provably lies among them needs
    no full sort."""
    vocab = scaled.shape[1]
    if vocab <= 2 * PREFILTER:
        return _sorted_threshold(scaled.sort(dim=1, descending=True).values, k, top_p, None)[0]
    values = scaled.topk(PREFILTER, dim=1).values
    # normalise over the whole row (top_k off) or over the top k (k <= PREFILTER): both are known here
    lse = torch.where(k >= vocab, scaled.logsumexp(dim=1), _masked(values, k).logsumexp(dim=1))
    threshold, head_mass = _sorted_threshold(values, k, top_p, lse)
    covered = (k <= PREFILTER) | ((k >= vocab) & (head_mass >= top_p))
    if not bool(covered.all()):
        rest = torch.nonzero(~covered).squeeze(1)
        full = scaled[rest].sort(dim=1, descending=True).values
        threshold[rest] = _sorted_threshold(full, k[rest], top_p[rest], None)[0]
    return threshold


def _masked(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    rank = torch.arange(values.shape[1], device=values.device)
    return values.masked_fill(rank.unsqueeze(0) >= k.unsqueeze(1), float("-inf"))


def _sorted_threshold(values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                      lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest kept value, mass of `values`) for descending `values`: a whole row, or its head when
    lse, the row's log-normaliser, is given."""
    masked = _masked(values, k)
    probs = masked.softmax(dim=1) if lse is None else (masked - lse.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=1)
    # keep while the mass strictly before a token is < top_p: the top token always stays; a prefix
    keep = ~torch.isneginf(masked) & (cum - probs < top_p.unsqueeze(1))
    last = keep.sum(dim=1).clamp(min=1) - 1
    return values.gather(1, last.unsqueeze(1)).squeeze(1), cum[:, -1]
