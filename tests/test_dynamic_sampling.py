"""Dynamic sampling (rollout_service/dynamic_sampling.py): client.generate_groups in-process and through
Ray. The reward rollout_service.rewards.examples:difficulty_reward makes "easy" and "hard" groups constant
(always dropped by "nonconstant") and "medium" ones mixed (parity of the sampled tokens)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollout_service.client import RolloutClient
from rollout_service.dynamic_sampling import IN_FLIGHT_PER_WORKER, GroupsResult
from rollout_service.api.types import RolloutRequest, SamplingParams
from tiny_models import tiny_hf_model

pytest_plugins = ["ray_fixtures"]

DIFFICULTY = "rollout_service.rewards.examples:difficulty_reward"
SP = SamplingParams(n=4, temperature=1.0, max_tokens=6, ignore_eos=True, seed=5)


@pytest.fixture(scope="module")
def local():
    c = RolloutClient.local(tiny_hf_model(), backend="torch", dtype="float32", device="cpu", num_pages=512,
                            enable_cuda_graphs=False)
    yield c
    c.close()


@pytest.fixture(scope="module")
def service(ray_cluster, service_config):
    with RolloutClient.launch(service_config(name="svc-dynamic-sampling", num_workers=1)) as c:
        yield c


def _prompts(k: int) -> tuple[list[list[int]], list[dict]]:
    kinds = ["easy", "medium", "hard", "medium"]
    return [[1 + i, 2 + i % 7, 3] for i in range(k)], [{"difficulty": kinds[i % 4], "index": i} for i in range(k)]


def _check_counts(res: GroupsResult, n: int) -> None:
    assert res.submitted == res.kept + res.dropped + res.failed + res.aborted
    assert res.kept == len(res.groups)
    kept_tokens = sum(len(r.token_ids) for g in res.groups for r in g)
    assert res.generated_tokens == kept_tokens + res.dropped_tokens + res.failed_tokens + res.aborted_tokens
    for g in res.groups:
        assert [r.sample_index for r in g] == list(range(n)) and len({r.request_id for r in g}) == 1
    assert res.seconds > 0


def _check_nonconstant(client) -> None:
    prompts, meta = _prompts(40)
    res = client.generate_groups(prompts, SP, target_groups=6, reward=DIFFICULTY, metadata=meta)
    _check_counts(res, SP.n)
    assert res.complete and res.reason is None and res.kept == 6 and res.failed == 0
    assert res.submitted <= 24  # max_oversample 4.0
    for g in res.groups:
        assert len({r.reward for r in g}) > 1 and g[0].metadata["difficulty"] == "medium"
    assert res.dropped >= 1 and res.dropped_tokens == res.dropped * SP.n * SP.max_tokens


def _check_callable_filter_and_iterator(client) -> None:
    prompts, meta = _prompts(40)
    drawn = []

    def source():
        for p in prompts:
            drawn.append(p)
            yield p

    res = client.generate_groups(source(), SP, keep=lambda g: g[0].metadata["index"] % 3 == 0, target_groups=3,
                                 metadata=iter(meta), max_oversample=3.0)
    _check_counts(res, SP.n)
    assert res.complete and all(g[0].metadata["index"] % 3 == 0 for g in res.groups)
    assert all(r.reward is None for g in res.groups for r in g)  # no reward named, none needed
    assert len(drawn) == res.submitted <= 9  # prompts are drawn only as they are submitted


def _check_abort_of_unneeded_groups(client) -> None:
    """Two short groups are enough; the long ones in flight then are aborted, their tokens so far counted."""
    short = SamplingParams(n=2, temperature=1.0, max_tokens=2, ignore_eos=True, seed=1)
    long = SamplingParams(n=2, temperature=1.0, max_tokens=400, ignore_eos=True, seed=1)
    reqs = [RolloutRequest([5, 6, 7 + i], short if i < 2 else long, metadata=i) for i in range(20)]
    res = client.generate_groups(iter(reqs), short, keep=lambda g: True, target_groups=2)
    _check_counts(res, 2)
    assert res.complete and sorted(g[0].metadata for g in res.groups) == [0, 1]
    assert res.aborted == res.submitted - 2 >= 1 and res.dropped == res.failed == 0
    assert 0 < res.aborted_tokens < res.aborted * 2 * 400
    assert client.info()["in_flight"] == 0


def _check_failed_groups(client) -> None:
    """A reward error in a group: the group is failed, not dropped; the call goes on. One more group is asked
    for than can pass, so the call judges every group whatever order the reward threads finish in."""
    fail = "rollout_service.rewards.examples:failing_reward"
    meta = [{"fail": i % 2 == 0} for i in range(12)]
    res = client.generate_groups(iter([[9, i + 1] for i in range(12)]), SP, keep=lambda g: True, target_groups=7,
                                 reward=fail, metadata=meta)
    _check_counts(res, SP.n)
    assert not res.complete and "ran out" in res.reason
    assert res.kept == 6 and res.failed == 6 and res.failed_tokens == 6 * SP.n * SP.max_tokens
    assert all(not g[0].metadata["fail"] for g in res.groups)


def _check_incomplete(client) -> None:
    never = lambda g: False  # noqa: E731
    res = client.generate_groups([[1, i + 1] for i in range(20)], SP, keep=never, target_groups=3,
                                 max_oversample=2)
    assert not res.complete and res.submitted == 6 and res.dropped == 6 and "max_oversample" in res.reason
    res = client.generate_groups(iter([[1, 2], [3, 4]]), SP, keep=never, target_groups=3)
    assert not res.complete and res.submitted == 2 and "ran out" in res.reason


def _check_bad_input(client, default_reward: bool) -> None:
    prompts, meta = _prompts(8)
    cases = [
        (dict(keep="nonzero"), r"keep='nonzero': must be a callable keep\(group\) -> bool or one of \['nonconstant'\]"),
        (dict(keep=3), "keep=3"),
        (dict(sampling=SamplingParams(n=1)), r"sampling.n=1: a group needs n >= 2"),
        (dict(target_groups=9), "target_groups=9 but only 8 prompts"),
        (dict(target_groups=0), "target_groups=0 must be an int >= 1"),
        (dict(max_oversample=0.5), "max_oversample=0.5 must be a number >= 1"),
        (dict(reward="rollout_service.no_such_module:f"), "cannot import module"),
        (dict(prompts=[RolloutRequest([1, 2], SamplingParams(n=1))] * 4, metadata=None), r"sampling.n=1"),
        (dict(metadata=meta[:3]), "metadata has 3 entries for 8 prompts"),
    ]
    if not default_reward:
        cases.append((dict(reward=None), "keep='nonconstant' compares rewards, and none would be computed"))
    for kw, match in cases:
        args = {**dict(prompts=prompts, sampling=SP, target_groups=2, reward=DIFFICULTY, metadata=meta), **kw}
        with pytest.raises(ValueError, match=match):
            client.generate_groups(args.pop("prompts"), args.pop("sampling"), **args)
    assert client.info()["in_flight"] == 0  # nothing was left running


class Boom(Exception):
    pass


def _counting(prompts, fail_at: int | None = None, error: Exception | None = None):
    """A generator over prompts that records how many were drawn, and raises `error` at draw `fail_at`."""
    drawn = []

    def gen():
        for i, p in enumerate(prompts):
            if i == fail_at:
                raise error
            drawn.append(p)
            yield p
    return gen(), drawn


def _check_keep_that_raises_returns_what_was_gathered(client) -> None:
    for error in (Boom, SystemExit):  # SystemExit too: keep's doing, not the caller's
        calls = []

        def keep(group):
            calls.append(group)
            if len(calls) == 3:
                raise error("keep broke")
            return True

        prompts, meta = _prompts(40)
        res = client.generate_groups(prompts, SP, keep=keep, target_groups=6, metadata=meta)
        _check_counts(res, SP.n)
        assert not res.complete and res.kept == 2 and len(res.groups) == 2
        assert isinstance(res.error, error) and "keep failed" in res.reason
        assert f"{error.__name__}: keep broke" in res.reason
        assert res.unjudged == [calls[2]] and res.failed >= 1
        assert client.info()["in_flight"] == 0


def _check_keep_must_return_a_bool(client) -> None:
    for verdict in ("no", 0.5, float("nan"), 1, None):
        prompts, meta = _prompts(8)
        res = client.generate_groups(prompts, SP, keep=lambda g: verdict, target_groups=2, metadata=meta)
        _check_counts(res, SP.n)
        assert not res.complete and res.kept == 0 and isinstance(res.error, ValueError)
        assert f"keep returned {verdict!r} (a {type(verdict).__name__}), not a bool" in res.reason
    res = client.generate_groups(prompts, SP, keep=lambda g: np.bool_(True), target_groups=2, metadata=meta)
    assert res.complete and res.error is None  # numpy's bool is a bool
    assert client.info()["in_flight"] == 0


def _check_failing_source_keeps_what_it_drew(client) -> None:
    """The iterator raises after 10 prompts: those 10 groups still run and are judged."""
    prompts, _ = _prompts(40)
    source, drawn = _counting(prompts, fail_at=10, error=Boom("disk gone"))
    res = client.generate_groups(source, SP, keep=lambda g: True, target_groups=12)
    _check_counts(res, SP.n)
    assert len(drawn) == res.submitted == res.kept == 10 and not res.complete
    assert isinstance(res.error, Boom) and res.reason == "the prompt source failed after 10 prompts: Boom: disk gone"
    # metadata running short of the prompts: the same
    res = client.generate_groups(iter(prompts), SP, keep=lambda g: True, target_groups=12, metadata=iter(range(6)))
    _check_counts(res, SP.n)
    assert res.kept == 6 and sorted(g[0].metadata for g in res.groups) == list(range(6)) and not res.complete
    assert isinstance(res.error, ValueError) and "metadata ran out before the prompts" in res.reason


def _check_refused_chunk_comes_back_unsubmitted(client) -> None:
    """A bad prompt in a later chunk: the chunk is refused and returned, the groups in flight are judged."""
    prompts = [[1, i + 1] for i in range(60)]
    prompts[30] = [1, -1]
    source, drawn = _counting(prompts)
    res = client.generate_groups(source, SP, keep=lambda g: False, target_groups=2, max_oversample=30)
    _check_counts(res, SP.n)
    assert not res.complete and isinstance(res.error, ValueError) and res.unsubmitted
    assert "drawn as one chunk, were refused" in res.reason and "token id -1" in res.reason
    assert ([1, -1], None) in res.unsubmitted and res.submitted + len(res.unsubmitted) == len(drawn)
    assert res.dropped == res.submitted  # every group submitted was judged


def _check_errors_before_anything_runs_are_raised(client) -> None:
    source, _ = _counting([[1, 2]] * 8, fail_at=0, error=Boom("no data"))
    with pytest.raises(Boom, match="no data"):
        client.generate_groups(source, SP, keep=lambda g: True, target_groups=2)
    assert client.info()["in_flight"] == 0


def _check_huge_target_draws_in_bounded_chunks(client) -> None:
    """target_groups=10**6 over an endless source: prompts are drawn a bounded chunk at a time."""
    def endless():
        for i in itertools.count():
            assert i < 100_000, "drew 100,000 prompts at once"
            yield [1, 2 + i % 200]
    res = client.generate_groups(endless(), SP, keep=lambda g: (_ for _ in ()).throw(Boom("enough")),
                                 target_groups=10**6)
    cap = client.info()["num_workers"] * IN_FLIGHT_PER_WORKER // SP.n
    assert isinstance(res.error, Boom) and 1 <= res.submitted <= cap and res.kept == 0
    res = client.generate_groups(endless(), SP, keep=lambda g: True, target_groups=2, max_oversample=1e308)
    assert res.complete and res.submitted <= 5
    res = client.generate_groups(endless(), SP, keep=lambda g: True, target_groups=2, max_oversample=10**400)
    assert res.complete


def _check_keep_cannot_edit_a_group(client) -> None:
    """keep judges a copy: one that drops a sample from the list it got still keeps whole groups."""
    def keep_edits(group: list) -> bool:
        group.pop()
        return True

    prompts = ([1, 2 + i] for i in range(100))
    res = client.generate_groups(prompts, SP, keep=keep_edits, target_groups=2)
    assert res.complete and res.kept == 2
    _check_counts(res, SP.n)  # every kept group holds samples 0..n-1


CHECKS = [_check_nonconstant, _check_callable_filter_and_iterator, _check_abort_of_unneeded_groups,
          _check_failed_groups, _check_incomplete, _check_keep_that_raises_returns_what_was_gathered,
          _check_keep_must_return_a_bool, _check_failing_source_keeps_what_it_drew,
          _check_refused_chunk_comes_back_unsubmitted, _check_errors_before_anything_runs_are_raised,
          _check_huge_target_draws_in_bounded_chunks, _check_keep_cannot_edit_a_group]


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__[len("_check_"):])
def test_local(local, check):
    check(local)


def test_local_bad_input(local):
    _check_bad_input(local, default_reward=False)


def test_local_default_reward_is_enough_for_nonconstant():
    c = RolloutClient.local(tiny_hf_model(), backend="torch", dtype="float32", device="cpu", num_pages=256,
                            enable_cuda_graphs=False, reward=DIFFICULTY)
    try:
        prompts, meta = _prompts(16)
        res = c.generate_groups(prompts, SP, target_groups=2, metadata=meta)
        assert res.complete and all(len({r.reward for r in g}) > 1 for g in res.groups)
    finally:
        c.close()


@pytest.mark.ray
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__[len("_check_"):])
def test_ray(service, check):
    check(service)


@pytest.mark.ray
def test_ray_bad_input(service):
    _check_bad_input(service, default_reward=False)
