"""Sampler: one step's logits [B, V] and the batch's sequences -> tokens and behaviour log-probs.

Per row (each sequence uses its own SamplingParams; rows never influence one another):
1. penalised = the raw logits after repetition / frequency / presence penalties (logits_processors.py).
2. Greedy rows (temperature == 0): token = argmax(penalised). Their log-probs are reported in "raw" mode
   whatever logprobs_mode says (greedy has no sampling distribution to report).
3. Other rows: scaled = penalised / temperature; truncated = scaled with the tokens dropped by top_k,
   top_p and min_p set to -inf (logits_processors.py); processed = log_softmax(truncated).
   token = argmax(truncated + gumbel), an exact draw from softmax(truncated) (Gumbel-max), where the
   Gumbel noise is a counter-based hash of (seed + sample_index, step = num_output_tokens, vocab id)
   (random.py): a sequence's token depends only on its own counters and logits, whatever the batch,
   the device, or a preemption and recompute in between.
4. logprobs[b] = log-prob of the chosen token under the row's logprobs_mode:
     "processed": log_softmax(truncated), the distribution actually sampled from;
     "scaled":    log_softmax(scaled), after penalties and temperature, before truncation;
     "raw":       log_softmax(logits), the model's own distribution.
   With K = max(sampling.logprobs) over the batch (capped at V), top_ids / top_logprobs [B, K] are the
   K most likely tokens of that same distribution, best first (rows that asked for fewer get extra
   columns for the caller to trim; tokens dropped by truncation show -inf in "processed" mode).
5. draft_top = D > 0 (speculation's drafter asks): draft_ids / draft_logprobs [B, D] are the D likeliest tokens
   of the distribution each row's token was drawn from ("processed"; greedy rows: penalised), whatever the
   logprobs_mode.

Cost: work no row needs is skipped (no penalties -> untouched logits; temperature 1 -> no division;
no top_k / top_p -> no sort, top_k alone -> topk only; all greedy -> no noise). Penalties touch only
the rows' own token ids (gather/scatter). top_k and top_p share one sort, and a top_p row whose kept
set lies in its 1024 best tokens needs no full sort at all. On the CPU, when every sampled row keeps few
tokens only those get noise. A draw over the full vocabulary is the backend's gumbel_argmax: the torch
reference makes the noise in cache-sized blocks on CPU, the CUDA kernel in registers in one pass over the
logits. None of this changes a token.
On a GPU nothing here reads a value back (host lists go up through pinned memory), so an overlapped decode
step never waits for the step queued before it; only top_p's prefilter check does.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import torch

from rollout_service.engine.logits_processors import apply_penalties, truncation_mask
from rollout_service.ops.random import gumbel, row_key
from rollout_service.engine.sequence import Sequence
from rollout_service.engine.transfers import to_device
from rollout_service.ops.backend import Ops, select_ops
from rollout_service.api.types import SamplingParams

_FEW_CANDIDATES = 8       # noise only the kept tokens when at most 1/8 of the vocabulary is kept


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                     # int64 [B]
    logprobs: torch.Tensor                      # float32 [B]
    top_ids: torch.Tensor | None = None         # int64 [B, K]
    top_logprobs: torch.Tensor | None = None    # float32 [B, K]
    draft_ids: torch.Tensor | None = None       # int64 [B, D]
    draft_logprobs: torch.Tensor | None = None  # float32 [B, D]


@dataclass
class _RowParams:
    """Per-row sampling parameters as Python lists (B is small; tensors are built only where needed)."""

    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    repetition: list[float]
    frequency: list[float]
    presence: list[float]
    modes: list[str]
    num_top: int

    @classmethod
    def of(cls, seqs: list[Sequence]) -> "_RowParams":
        ps = [s.sampling for s in seqs]
        return cls([float(p.temperature) for p in ps], [int(p.top_k) for p in ps], [float(p.top_p) for p in ps],
                   [float(p.min_p) for p in ps], [float(p.repetition_penalty) for p in ps],
                   [float(p.frequency_penalty) for p in ps], [float(p.presence_penalty) for p in ps],
                   ["raw" if p.temperature == 0 else p.logprobs_mode for p in ps],
                   max(int(p.logprobs) for p in ps))

    @property
    def penalised(self) -> bool:
        return any(r != 1.0 for r in self.repetition) or any(self.frequency) or any(self.presence)

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, unpenalised, without alternatives: token = argmax, log-prob "raw"."""
        return self.num_top == 0 and not any(self.temperature) and not self.penalised


def needs_history(sp: SamplingParams) -> bool:
    """Whether sampling needs every earlier token of the sequence on the host (the penalties do)."""
    return sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0


class Sampler:
    """Stateless: `Sampler()(logits, seqs)` samples one token per sequence (see the module docstring).
    ops: the backend whose gumbel_argmax draws from the full vocabulary (the CUDA one fuses the noise) and
    whose argmax_logsumexp serves plain greedy batches (the CUDA one in one read of the logits)."""

    def __init__(self, ops: Ops | None = None) -> None:
        self.ops = ops if ops is not None else select_ops("torch")

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0, draft_top: int = 0) -> SamplerOutput:
        """ahead=1: each sequence has one sampled token not yet recorded (an overlapped decode step), so
        its noise counter is num_output_tokens + 1. Penalties need every earlier token: not allowed then.
        draft_top: see the module docstring's 5."""
        logits = _checked(logits, seqs)
        batch, vocab = logits.shape
        dev = logits.device
        if batch == 0:
            return SamplerOutput(torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, device=dev))
        rp = _RowParams.of(seqs)
        if ahead and rp.penalised:
            raise ValueError("Sampler: penalties need every earlier token; a step ahead cannot apply them")
        if rp.plain_greedy:
            # the common rollout-evaluation case: token, its logit and the normaliser (one pass on CUDA)
            tokens, values, lse = self.ops.argmax_logsumexp(logits)
            norms = _Normalisers({"raw": logits}, None, self.ops, known={"raw": lse})
            return _with_drafting(SamplerOutput(tokens, values - lse), norms, rp, draft_top, "raw")
        penalised = apply_penalties(logits, [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                                    rp.repetition, rp.frequency, rp.presence)
        tokens = torch.empty(batch, dtype=torch.int64, device=dev)
        sources, kept = _distributions(logits, penalised, rp)
        greedy = [i for i in range(batch) if rp.temperature[i] == 0]
        sampled = [i for i in range(batch) if rp.temperature[i] != 0]
        if greedy:
            _assign(tokens, greedy, _rows(penalised, greedy).argmax(dim=1))
        if sampled:
            keys = to_device([row_key(int(s.seed), int(s.sample_index), s.num_output_tokens + ahead)
                              for s in (seqs[i] for i in sampled)], dev, torch.int64)
            _assign(tokens, sampled, _draw(_rows(sources["processed"], sampled), keys, kept, self.ops))
        norms = _Normalisers(dict(sources, penalised=penalised), _kept_lse(kept, sampled, batch, self.ops), self.ops)
        out = _report(norms, rp.modes, tokens, min(rp.num_top, vocab))
        # greedy rows draw from the penalised logits: the raw ones (the report's) where no row is penalised
        return _with_drafting(out, norms, rp, draft_top, "raw" if penalised is logits else "penalised")

    def score(self, logits: torch.Tensor, seqs: list[Sequence], targets: list[int]) -> SamplerOutput:
        """The log-prob of targets[b] (and the top alternatives) under row b's distribution, as __call__ reports
        a token it drew there: the same arithmetic, so a scored token's log-prob is bitwise the one its rollout
        reported where the logits are bitwise the same (batch-invariant mode). Scoring takes no penalties."""
        logits = _checked(logits, seqs)
        rp = _RowParams.of(seqs)
        if rp.penalised:
            raise ValueError("Sampler.score: penalties depend on each scored prefix; scoring takes none")
        tokens = to_device(targets, logits.device, torch.int64)
        sources, kept = _distributions(logits, logits, rp)
        sampled = [i for i in range(len(seqs)) if rp.temperature[i] != 0]
        norms = _Normalisers(sources, _kept_lse(kept, sampled, len(seqs), self.ops), self.ops)
        return _report(norms, rp.modes, tokens, min(rp.num_top, logits.shape[1]))


def _distributions(logits: torch.Tensor, penalised: torch.Tensor, rp: _RowParams):
    """({"raw", "scaled", "processed"}: the rows' distributions before normalisation, kept) where kept is
    _truncate's (the surviving tokens of every sampled row, when few)."""
    sources = {"raw": logits}
    sampled = [i for i in range(logits.shape[0]) if rp.temperature[i] != 0]
    if not sampled:
        return sources, None
    scaled = penalised
    if any(rp.temperature[i] != 1.0 for i in sampled):
        temps = to_device([t if t != 0 else 1.0 for t in rp.temperature], logits.device)
        scaled = penalised / temps.unsqueeze(1)
    truncated, kept = _truncate(scaled, sampled, rp)
    sources.update(scaled=scaled, processed=truncated)
    return sources, kept


def _kept_lse(kept, sampled: list[int], batch: int, ops: Ops) -> torch.Tensor | None:
    """The "processed" normaliser of the sampled rows from their kept tokens alone (NaN elsewhere)."""
    if kept is None:
        return None
    lse = torch.full((batch,), float("nan"), device=kept[0].device)
    _assign(lse, sampled, ops.logsumexp(kept[0]))
    return lse


def _checked(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError("Sampler: logits must be a floating-point tensor of shape [batch, vocab]")
    if logits.shape[0] != len(seqs):
        raise ValueError(f"Sampler: logits has {logits.shape[0]} rows but {len(seqs)} sequences were given")
    if logits.shape[1] == 0:
        raise ValueError("Sampler: logits has an empty vocabulary dimension")
    for s in seqs:
        # exact type checks first: the abstract Integral check costs ~1 us a row, every step
        ok = type(s.seed) is int and type(s.sample_index) is int or (
            isinstance(s.seed, Integral) and isinstance(s.sample_index, Integral))
        if not ok or s.seed < 0 or s.sample_index < 0:
            raise ValueError(f"Sampler: {s!r} needs an int seed >= 0 and sample_index >= 0, "
                             f"got seed={s.seed!r}, sample_index={s.sample_index!r}")
    return logits.float()


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t restricted to `rows` (t itself when rows is the whole batch, in order)."""
    if len(rows) == t.shape[0]:
        return t
    return t[to_device(rows, t.device)]


def _assign(out: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    if len(rows) == out.shape[0]:
        out.copy_(values)
    else:
        out[to_device(rows, out.device)] = values


def _truncate(scaled: torch.Tensor, sampled: list[int], rp: _RowParams):
    """(scaled with top_k / top_p / min_p drops at -inf, kept). Only rows that ask for truncation pay
    for it. kept = (values, ids) [S, M] holding every surviving token of the sampled rows, when all
    of them are truncated to at most 1/_FEW_CANDIDATES of the vocabulary; else None."""
    rows = [i for i in sampled if rp.top_k[i] != -1 or rp.top_p[i] < 1.0 or rp.min_p[i] > 0.0]
    if not rows:
        return scaled, None
    sub = _rows(scaled, rows)
    drop = truncation_mask(sub, [rp.top_k[i] for i in rows], [rp.top_p[i] for i in rows],
                           [rp.min_p[i] for i in rows])
    sub = sub.masked_fill(drop, float("-inf"))
    if len(rows) == scaled.shape[0]:
        truncated = sub
    else:
        truncated = scaled.clone()
        truncated[to_device(rows, scaled.device)] = sub
    kept = None
    # (on CPU only: sizing the kept set reads a count back, which on a GPU would wait for the queued steps)
    if len(rows) == len(sampled) and scaled.device.type == "cpu":  # sub holds exactly the sampled rows
        vocab = scaled.shape[1]
        most = vocab - int(drop.sum(dim=1, dtype=torch.int32).min())
        if most * _FEW_CANDIDATES <= vocab:
            kept = sub.topk(most, dim=1)
    return truncated, kept


def _draw(x: torch.Tensor, keys: torch.Tensor, kept, ops: Ops) -> torch.Tensor:
    """Per row b: argmax over vocab ids v of x[b, v] + gumbel(keys[b], v), a draw from softmax(x[b]).

    The noise of a token depends only on (key, token id), so the same winner comes out of any subset of
    columns that holds every finite entry: with `kept`, only the surviving tokens get noise.
    """
    if kept is not None:
        values, ids = kept
        best = (values + gumbel(keys, ids)).argmax(dim=1, keepdim=True)
        return ids.gather(1, best).squeeze(1)
    return ops.gumbel_argmax(x, keys)


class _Normalisers:
    """The rows of a source distribution ("raw", "scaled", "processed", "penalised") with their logsumexp, each
    taken once per call: the report and the drafting read the same ones. For "processed" rows the normaliser comes
    from the kept tokens when known (exp of the many -inf entries is slow on CPU); `known`: a source's normaliser
    over the whole batch, already at hand."""

    def __init__(self, sources: dict[str, torch.Tensor], kept_lse: torch.Tensor | None, ops: Ops,
                 known: dict[str, torch.Tensor] | None = None):
        self.sources, self.kept_lse, self.ops = sources, kept_lse, ops
        batch = next(iter(sources.values())).shape[0]
        self._done = {(name, tuple(range(batch))): (sources[name], lse.unsqueeze(1))
                      for name, lse in (known or {}).items()}

    def of(self, name: str, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, lse): the source's `rows` [R, V] and their logsumexp [R, 1]."""
        key = (name, tuple(rows))
        if key not in self._done:
            x = _rows(self.sources[name], rows)
            lse = _rows(self.kept_lse, rows) if name == "processed" and self.kept_lse is not None \
                else self.ops.logsumexp(x)
            self._done[key] = (x, lse.unsqueeze(1))
        return self._done[key]


def _report(norms: _Normalisers, modes: list[str], tokens: torch.Tensor, k: int) -> SamplerOutput:
    """Log-probs of the chosen tokens (and the top k) under each row's mode's distribution, as
    x - logsumexp(x): one reduction, no [B, V] log_softmax."""
    batch, dev = tokens.shape[0], tokens.device
    groups = _rows_by(modes)
    logprobs = torch.empty(batch, dtype=torch.float32, device=dev)
    top_ids = torch.empty(batch, k, dtype=torch.int64, device=dev) if k else None
    top_lps = torch.empty(batch, k, dtype=torch.float32, device=dev) if k else None
    for mode, rows in groups.items():
        (x, lse), tok = norms.of(mode, rows), _rows(tokens, rows).unsqueeze(1)
        _assign(logprobs, rows, (x.gather(1, tok) - lse).squeeze(1))
        if k:
            values, ids = x.topk(k, dim=1)
            _assign(top_lps, rows, values - lse)
            _assign(top_ids, rows, ids)
    return SamplerOutput(tokens, logprobs, top_ids, top_lps)


def _with_drafting(out: SamplerOutput, norms: _Normalisers, rp: _RowParams, d: int, greedy: str) -> SamplerOutput:
    """out with draft_ids / draft_logprobs: each row's d likeliest tokens of the distribution it was drawn from
    ("processed"; greedy rows: the source named `greedy`)."""
    if d <= 0:
        return out
    rows = _rows_by(["processed" if t != 0 else greedy for t in rp.temperature])
    batch, d = out.token_ids.shape[0], min(d, norms.sources["raw"].shape[1])
    dev = out.token_ids.device
    out.draft_ids = torch.empty(batch, d, dtype=torch.int64, device=dev)
    out.draft_logprobs = torch.empty(batch, d, dtype=torch.float32, device=dev)
    for source, group in rows.items():
        x, lse = norms.of(source, group)
        values, ids = x.topk(d, dim=1)
        _assign(out.draft_logprobs, group, values - lse)
        _assign(out.draft_ids, group, ids)
    return out


def _rows_by(labels: list[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    return groups
