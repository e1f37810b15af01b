"""Sampler semantics against direct reference computations (CPU, small vocabularies, fast)."""
from __future__ import annotations

import math

import pytest
import torch

from rollout_service.engine.logits_processors import apply_penalties, truncation_mask
from rollout_service.engine.sampler import Sampler
from rollout_service.engine.sequence import Sequence
from rollout_service.ops.torch_ops import TorchOps
from rollout_service.api.types import SamplingParams


def make_seq(seed: int = 0, sample_index: int = 0, prompt=(1, 2, 3), output=(), **params) -> Sequence:
    seq = Sequence("req", list(prompt), SamplingParams(**params), seed=seed, sample_index=sample_index)
    for t in output:
        seq.append(t, 0.0, 0, None)
    return seq


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


# ---------------------------------------------------------------- greedy and penalties

def test_greedy_picks_argmax_and_reports_raw_logprob():
    logits = torch.randn(5, 64) * 3
    modes = ["processed", "scaled", "raw", "processed", "scaled"]
    seqs = [make_seq(seed=i, temperature=0.0, logprobs_mode=m, top_k=2, top_p=0.5) for i, m in enumerate(modes)]
    out = Sampler()(logits, seqs)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert torch.equal(out.token_ids, logits.argmax(1))
    raw = logits.log_softmax(1).gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, raw)
    assert out.top_ids is None and out.top_logprobs is None


def test_argmax_logsumexp_reference_special_values():
    """The contract the CUDA kernel is tested against (tests/gpu): torch's max and logsumexp, NaN first."""
    x = torch.randn(5, 50)
    x[1, 7] = x[1, 9] = float("nan")
    x[1, 2] = x[2, 3] = x[2, 40] = float("inf")
    x[3] = float("-inf")
    x[4] = 1.5
    tokens, values, lse = TorchOps().argmax_logsumexp(x)
    assert tokens.tolist() == [int(x[0].argmax()), 7, 3, 0, 0]
    assert torch.equal(values[[0, 2, 3, 4]], x[[0, 2, 3, 4], tokens[[0, 2, 3, 4]]]) and bool(values[1].isnan())
    assert lse[1].isnan() and lse[2].item() == float("inf") and lse[3].item() == float("-inf")
    torch.testing.assert_close(lse[[0, 4]], torch.stack([x[0].exp().sum().log(), torch.tensor(1.5 + math.log(50))]))


def reference_penalties(logits, prompt, output, rep, freq, pres):
    """Per-element reference, written independently of the vectorised code."""
    out = logits.clone()
    for v in range(logits.shape[0]):
        x = float(out[v])
        if v in prompt or v in output:
            x = x / rep if x > 0 else x * rep
        x -= freq * output.count(v)
        x -= pres * (1.0 if v in output else 0.0)
        out[v] = x
    return out


def test_penalties_match_per_element_reference():
    vocab = 24
    cases = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, -0.8),
             (1.5, 0.3, 0.4), (1.0, -1.2, 1.1), (2.0, 2.0, 2.0)]
    logits = torch.randn(len(cases), vocab) * 2
    prompts = [torch.randint(0, vocab, (int(torch.randint(0, 10, ())),)).tolist() for _ in cases]
    outputs = [torch.randint(0, vocab, (int(torch.randint(0, 12, ())),)).tolist() for _ in cases]
    outputs[1] = []  # repetition penalty from the prompt alone
    rep, freq, pres = ([c[j] for c in cases] for j in range(3))
    got = apply_penalties(logits, prompts, outputs, rep, freq, pres)
    for b, (r, f, p) in enumerate(cases):
        want = reference_penalties(logits[b], prompts[b], outputs[b], r, f, p)
        torch.testing.assert_close(got[b], want, msg=f"row {b} params {cases[b]}")
    assert not torch.equal(got[5], logits[5])  # the reference is not trivially the identity


def test_penalties_leave_rows_without_tokens_untouched():
    logits = torch.randn(3, 10)
    got = apply_penalties(logits, [[], [4], [0, 0]], [[], [], [0, 0, 3]], [1.5, 1.0, 1.0], [0.7, 0.7, 0.0],
                          [0.4, 0.4, 0.0])
    assert torch.equal(got[0], logits[0])  # nothing to penalise: its padding (token 0) stays untouched
    assert torch.equal(got[1], logits[1])  # presence/frequency look at the output only
    assert torch.equal(got[2], logits[2])  # all penalties neutral


def test_greedy_uses_penalised_logits_but_reports_raw():
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    seq = make_seq(temperature=0.0, output=[0, 0], frequency_penalty=1.0)
    out = Sampler()(logits, [seq])
    assert out.token_ids.item() == 1  # token 0 is penalised by 2 below token 1
    assert out.logprobs.item() == pytest.approx(logits.log_softmax(1)[0, 1].item(), abs=1e-6)


def test_penalty_token_out_of_vocab_is_value_error():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Sampler()(torch.randn(1, 8), [make_seq(output=[9], presence_penalty=0.5)])


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.randn(2, 8), [make_seq()])
    with pytest.raises(ValueError, match="shape"):
        Sampler()(torch.randn(8), [make_seq()])
    unseeded = make_seq()
    unseeded.seed = None
    with pytest.raises(ValueError, match="seed"):
        Sampler()(torch.randn(1, 8), [unseeded])


# ---------------------------------------------------------------- truncation

def reference_keep(row, top_k, top_p, min_p):
    """Brute force in float64: the set of token ids kept (HF order top_k -> top_p -> min_p)."""
    x = row.double()
    order = sorted(range(len(x)), key=lambda v: -float(x[v]))
    keep = order[: (len(x) if top_k == -1 else top_k)]
    z = sum(math.exp(float(x[v])) for v in keep)
    kept, mass = [], 0.0
    for v in keep:
        if mass >= top_p:
            break
        kept.append(v)
        mass += math.exp(float(x[v])) / z
    top = float(x.max())
    return {v for v in kept if math.exp(float(x[v]) - top) >= min_p}


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (-1, 0.8, 0.0), (-1, 1.0, 0.1), (10, 0.6, 0.0),
                                               (3, 0.9, 0.2), (-1, 0.3, 0.05), (1, 1.0, 0.0), (50, 0.95, 0.0)])
def test_truncation_mask_matches_brute_force(top_k, top_p, min_p):
    rows = torch.randn(6, 40) * 2
    drop = truncation_mask(rows, [top_k] * 6, [top_p] * 6, [min_p] * 6)
    for b in range(6):
        kept = set(torch.nonzero(~drop[b]).flatten().tolist())
        assert kept == reference_keep(rows[b], top_k, top_p, min_p)


def test_truncation_mask_mixed_rows():
    rows = torch.randn(4, 30)
    params = [(-1, 1.0, 0.0), (4, 1.0, 0.0), (-1, 0.5, 0.0), (2, 1.0, 0.3)]
    drop = truncation_mask(rows, [p[0] for p in params], [p[1] for p in params], [p[2] for p in params])
    assert not drop[0].any()
    for b, p in enumerate(params):
        assert set(torch.nonzero(~drop[b]).flatten().tolist()) == reference_keep(rows[b], *p)


def test_ties_at_the_boundary_are_kept_whatever_the_sort_order():
    kept = lambda drop: set(torch.nonzero(~drop[0]).flatten().tolist())  # noqa: E731
    row = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    assert kept(truncation_mask(row, [2], [1.0], [0.0])) == {0, 1, 2, 3}
    assert kept(truncation_mask(row[:, [5, 3, 0, 1, 4, 2]], [2], [1.0], [0.0])) == {1, 2, 3, 5}
    row = torch.tensor([[1.0, 2.0, 1.0, 0.0]])  # probs .197 .534 .197 .072: top_p 0.6 keeps 1 and 0, then 2 ties
    assert kept(truncation_mask(row, [-1], [0.6], [0.0])) == {0, 1, 2}
    # bf16-rounded logits tie a lot: a wide row must still agree with its own permutation
    wide = (torch.randn(1, 3000) * 2).bfloat16().float()
    perm = torch.randperm(3000)
    a = truncation_mask(wide, [40], [0.7], [0.0])
    b = truncation_mask(wide[:, perm], [40], [0.7], [0.0])
    assert torch.equal(a[:, perm], b)


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.3), dict(top_k=4, top_p=0.7)])
def test_masked_tokens_are_never_sampled(params):
    logits = torch.linspace(2.0, -2.0, 12).unsqueeze(0)
    # truncation acts on the temperature-scaled logits
    allowed = reference_keep(logits[0] / 1.5, params.get("top_k", -1), params.get("top_p", 1.0),
                             params.get("min_p", 0.0))
    assert 1 < len(allowed) < 12
    seqs = [make_seq(seed=s, temperature=1.5, **params) for s in range(3000)]
    out = Sampler()(logits.expand(len(seqs), -1), seqs)
    drawn = set(out.token_ids.tolist())
    assert drawn <= allowed
    assert drawn == allowed  # every kept token shows up in 3000 draws


# ---------------------------------------------------------------- sampling statistics

CHI2_7DOF_P1E4 = 29.88  # chi-square critical value, 7 degrees of freedom, p = 1e-4


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def draw(logits_row: torch.Tensor, n: int, **params) -> torch.Tensor:
    """n draws of one distribution with different seeds / sample indices / steps."""
    seqs = [make_seq(seed=1000 + i // 4, sample_index=i % 4, output=[0] * (i % 3), **params) for i in range(n)]
    return Sampler()(logits_row.expand(n, -1).contiguous(), seqs).token_ids


def test_frequencies_match_softmax_over_temperature():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5])
    temperature = 0.7
    counts = torch.bincount(draw(logits, 20000, temperature=temperature), minlength=8).double()
    probs = (logits.double() / temperature).softmax(0)
    assert chi_square(counts, probs) < CHI2_7DOF_P1E4
    wrong = logits.double().softmax(0)  # the untempered distribution must be rejected
    assert chi_square(counts, wrong) > 100


def test_frequencies_match_renormalised_top_p():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.2, 1.5])
    counts = torch.bincount(draw(logits, 20000, top_p=0.8), minlength=8).double()
    keep = sorted(reference_keep(logits, -1, 0.8, 0.0))
    assert 2 < len(keep) < 8
    outside = [v for v in range(8) if v not in keep]
    assert counts[outside].sum() == 0
    probs = logits.double()[keep].softmax(0)
    # len(keep) - 1 degrees of freedom <= 7, so the 7-dof bound is conservative
    assert chi_square(counts[keep], probs) < CHI2_7DOF_P1E4


# ---------------------------------------------------------------- determinism and independence

def test_batch_independence():
    vocab = 300
    target = torch.randn(vocab) * 2
    params = dict(temperature=0.9, top_p=0.95, logprobs=2, logprobs_mode="scaled")
    for step in range(6):
        alone = Sampler()(target[None], [make_seq(seed=77, sample_index=1, output=[5] * step, **params)])
        mates = [make_seq(seed=s, output=[1] * (s % 5), temperature=[0.0, 0.5, 1.3][s % 3],
                          top_k=[-1, 7][s % 2], min_p=[0.0, 0.1][s % 2], repetition_penalty=1.2,
                          logprobs=s % 4) for s in range(15)]
        batch_logits = torch.randn(16, vocab) * 3
        batch_logits[9] = target
        batch = mates[:9] + [make_seq(seed=77, sample_index=1, output=[5] * step, **params)] + mates[9:]
        out = Sampler()(batch_logits, batch)
        assert out.token_ids[9] == alone.token_ids[0]
        torch.testing.assert_close(out.logprobs[9], alone.logprobs[0])
        torch.testing.assert_close(out.top_logprobs[9, :2], alone.top_logprobs[0])


def test_same_counters_same_token_and_streams_differ():
    logits = torch.zeros(1, 1000)  # uniform: every draw is a fresh uniform pick
    sampler = Sampler()

    def token(seed, sample_index, step):
        return sampler(logits, [make_seq(seed=seed, sample_index=sample_index, output=[0] * step)]).token_ids.item()

    for step in range(5):
        assert token(3, 0, step) == token(3, 0, step)  # e.g. a recompute after preemption
    steps = range(40)
    base = [token(3, 0, t) for t in steps]
    assert sum(a != b for a, b in zip(base, [token(3, 1, t) for t in steps])) >= 35  # another sample index
    assert sum(a != b for a, b in zip(base, [token(4, 0, t) for t in steps])) >= 35  # another seed
    assert len(set(base)) >= 35  # successive steps differ too


# ---------------------------------------------------------------- logprob modes and top alternatives

def test_logprob_modes():
    logits = torch.randn(1, 50) * 2
    sampler = Sampler()

    def run(**params):
        return sampler(logits, [make_seq(seed=5, **params)])

    assert run(top_k=1, logprobs_mode="processed").logprobs.item() == pytest.approx(0.0, abs=1e-6)
    out = run(top_k=1, logprobs_mode="processed")
    assert out.token_ids.item() == logits.argmax().item()
    raw_lsm = logits.log_softmax(1)[0]
    for mode in ("scaled", "raw"):  # temperature 1, no penalties: scaled == raw
        out = run(logprobs_mode=mode)
        assert out.logprobs.item() == pytest.approx(raw_lsm[out.token_ids].item(), abs=1e-5)
    out = run(temperature=2.0, top_k=5, logprobs_mode="scaled")
    assert out.logprobs.item() == pytest.approx((logits / 2).log_softmax(1)[0, out.token_ids].item(), abs=1e-5)
    out = run(temperature=2.0, top_k=5, logprobs_mode="processed")
    top5 = torch.topk(logits[0] / 2, 5)
    processed = dict(zip(top5.indices.tolist(), top5.values.log_softmax(0).tolist()))
    assert out.logprobs.item() == pytest.approx(processed[out.token_ids.item()], abs=1e-5)
    out = run(temperature=2.0, top_k=5, logprobs_mode="raw")
    assert out.logprobs.item() == pytest.approx(raw_lsm[out.token_ids].item(), abs=1e-5)


def test_top_logprobs_per_row_mode():
    logits = torch.randn(3, 40)
    seqs = [make_seq(seed=1, logprobs=3, logprobs_mode="raw", temperature=0.5),
            make_seq(seed=2, logprobs=1, logprobs_mode="processed", top_k=2, temperature=0.5),
            make_seq(seed=3, logprobs=0, temperature=0.0)]
    out = Sampler()(logits, seqs)
    assert out.top_ids.shape == (3, 3) and out.top_logprobs.shape == (3, 3)
    raw = logits.log_softmax(1)
    want = raw.topk(3, dim=1)
    torch.testing.assert_close(out.top_logprobs[0], want.values[0])
    assert torch.equal(out.top_ids[0], want.indices[0])
    assert torch.equal(out.top_ids[2], want.indices[2])  # greedy rows report raw
    two = (logits[1] / 0.5).topk(2)
    assert out.top_ids[1, :2].tolist() == two.indices.tolist()
    torch.testing.assert_close(out.top_logprobs[1, :2], two.values.log_softmax(0))
    assert out.top_logprobs[1, 2].item() == float("-inf")  # beyond top_k: truncated away
    assert out.token_ids[1].item() in two.indices.tolist()


# ---------------------------------------------------------------- fast paths agree with the plain computation

def test_top_p_prefilter_matches_brute_force():
    vocab = 5000
    rows = torch.randn(6, vocab)
    rows[0, :20] += 12  # peaked: the kept set lies in the prefiltered head
    rows[1, 100:110] += 9
    params = [(-1, 0.9), (50, 0.5), (-1, 0.9), (3000, 0.95), (-1, 0.3), (1200, 0.99)]
    drop = truncation_mask(rows, [p[0] for p in params], [p[1] for p in params], [0.0] * 6)
    for b, (k, p) in enumerate(params):
        kept = set(torch.nonzero(~drop[b]).flatten().tolist())
        assert kept == reference_keep(rows[b], k, p, 0.0), f"row {b}"
    assert len(set(torch.nonzero(~drop[0]).flatten().tolist())) <= 20
    assert (~drop[2]).sum() > 1024  # a flat row needed the full-sort fallback


@pytest.mark.parametrize("vocab,keep", [(40_000, None), (3000, 40)])
def test_noise_paths_match_full_vocab_argmax(vocab, keep):
    from rollout_service.ops.random import gumbel, row_key, vocab_ids
    from rollout_service.engine.sampler import _draw

    x = torch.randn(5, vocab) * 2
    if keep is not None:  # few finite candidates: only they get noise
        x[:, keep:] = float("-inf")
        x = x[:, torch.randperm(vocab)]
    keys = torch.tensor([row_key(s, 0, 3) for s in range(5)])
    want = (x + gumbel(keys, vocab_ids(vocab))).argmax(dim=1)
    kept = x.topk(keep, dim=1) if keep is not None else None
    assert torch.equal(_draw(x, keys, kept, TorchOps()), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tokens_equal_cpu_tokens():
    vocab = 151_936
    kinds = [dict(temperature=0.0), dict(), dict(temperature=0.7, top_k=50), dict(top_p=0.9),
             dict(top_p=0.95, top_k=100, min_p=0.05, logprobs=3, logprobs_mode="scaled"),
             dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, logprobs_mode="raw")]
    seqs = [make_seq(seed=s, sample_index=s % 3, output=list(range(s % 7)), **kinds[s % len(kinds)])
            for s in range(32)]
    logits = torch.randn(32, vocab) * 3
    logits[::2, :10] += 15  # peaked rows take the top-p prefilter path, flat ones the full sort
    cpu, gpu = Sampler()(logits, seqs), Sampler()(logits.cuda(), seqs)
    assert gpu.token_ids.is_cuda
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    torch.testing.assert_close(cpu.logprobs, gpu.logprobs.cpu(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu.top_logprobs, gpu.top_logprobs.cpu(), rtol=1e-4, atol=1e-4)


def test_kept_candidate_path_matches_full_path_in_sampler():
    logits = torch.randn(8, 2000) * 2
    seqs = [make_seq(seed=s, top_k=20, temperature=0.8, logprobs=4) for s in range(8)]
    fast = Sampler()(logits, seqs)  # every row keeps 20 of 2000: only the kept tokens get noise
    mate = make_seq(seed=99)  # an untruncated batch mate forces the full-vocabulary path
    full = Sampler()(torch.cat([logits, torch.randn(1, 2000)]), seqs + [mate])
    assert torch.equal(fast.token_ids, full.token_ids[:8])
    torch.testing.assert_close(fast.logprobs, full.logprobs[:8])
    torch.testing.assert_close(fast.top_logprobs, full.top_logprobs[:8])
    assert torch.equal(fast.top_ids, full.top_ids[:8])
    want = (logits / 0.8).topk(20, dim=1).values.log_softmax(dim=1)
    torch.testing.assert_close(fast.top_logprobs, want[:, :4])
