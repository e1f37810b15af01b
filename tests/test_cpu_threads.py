"""A CPU engine's thread count under contention (ops/cpu_threads.py): the decision, its inputs (cgroup quota,
PSI, /proc/loadavg) read from files, and the property that makes switching safe: the engine's tokens and log-probs
are the same bits at one thread and at two."""
import numpy as np
import pytest
import torch

from rollout_service.engine.engine import Engine
from rollout_service.ops.cpu_threads import BUSY, SAMPLES, Pressure, _cgroup_quota, decide, usable_cpus
from rollout_service.api.types import RolloutRequest, SamplingParams
from tiny_models import tiny_hf_model


def test_the_decision_needs_agreeing_samples_and_goes_back_only_when_nothing_else_runs():
    busy, quiet = (BUSY + 0.2, 2), (0.0, 0)
    assert decide(2, 2, [busy] * (SAMPLES - 1)) == 2            # too few readings: unchanged
    assert decide(2, 2, [busy] * SAMPLES) == 1                   # tasks kept waiting: one thread
    assert decide(2, 2, [busy] * (SAMPLES - 1) + [quiet]) == 2   # one quiet reading: unchanged
    assert decide(1, 2, [(0.0, 1)] * SAMPLES) == 1               # nobody waits, but a neighbour still runs
    assert decide(1, 2, [quiet] * SAMPLES) == 2                  # the machine is ours again
    assert decide(2, 2, [(None, 1)] * SAMPLES) == 1              # no PSI: another runnable task in every reading
    assert decide(2, 2, [(None, 0)] * SAMPLES) == 2


def test_the_quota_and_the_pressure_are_read_from_their_files(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert _cgroup_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert _cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert _cgroup_quota(tmp_path) == 2.0
    psi, load = tmp_path / "psi", tmp_path / "loadavg"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=1000000\nfull avg10=0.00 total=0\n")
    load.write_text("2.10 1.50 1.20 4/300 12345\n")
    p = Pressure(psi, load)
    assert p.read(own_threads=2) == (0.0, 2)  # the first reading has no interval yet
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=9000000\n")
    share, others = p.read(own_threads=1)
    assert share > 0 and others == 3
    assert Pressure(tmp_path / "none", tmp_path / "none").read(1) == (None, 0)


def test_the_engines_bits_do_not_depend_on_the_thread_count():
    engine = Engine(model_source=tiny_hf_model("llama", seed=4), device="cpu", backend="torch", num_pages=128)
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    runs = []
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            for i in range(6):
                engine.add_request(RolloutRequest(list(range(3 + i, 40 + 3 * i)), sp, request_id=f"{threads}-{i}"))
            results = sorted(engine.run_until_done(), key=lambda r: r.request_id)
            runs.append(([r.token_ids for r in results], np.concatenate([r.logprobs for r in results])))
    finally:
        torch.set_num_threads(before)
    assert runs[0][0] == runs[1][0] and np.array_equal(runs[0][1], runs[1][1])


class _Busy:
    """A machine where tasks always wait for a CPU and three others are runnable."""

    def read(self, own_threads: int) -> tuple[float, int]:
        return 1.0, 3


class _Quiet:
    """A machine where nothing else runs (whatever the box running the test is doing)."""

    def read(self, own_threads: int) -> tuple[float, int]:
        return 0.0, 0


def _forward_thread_counts(engine: Engine) -> list[int]:
    seen: list[int] = []
    engine.runner.model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    return seen


def _run(engine: Engine, tag: str) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(RolloutRequest(list(range(3, 20)), sp, request_id=tag))
    return [r.token_ids for r in engine.run_until_done()]


@pytest.mark.skipif(usable_cpus() < 2, reason="needs two usable CPUs")
def test_a_contended_engine_steps_on_one_thread_and_gives_its_caller_its_count_back():
    engine = Engine(model_source=tiny_hf_model("llama", seed=4), device="cpu", backend="torch", num_pages=64)
    threads = engine.runner.cpu_threads
    threads.pressure, threads.interval_s = _Busy(), 0.0
    seen = _forward_thread_counts(engine)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _run(engine, "busy")
        assert seen[0] == 2 and seen[-1] == 1 and threads.switches == 1
        assert torch.get_num_threads() == 2  # the caller's count, though the engine still runs on one
        assert threads.current == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(usable_cpus() < 2, reason="needs two usable CPUs")
def test_the_callers_count_is_the_most_an_engine_uses():
    engine = Engine(model_source=tiny_hf_model("llama", seed=4), device="cpu", backend="torch", num_pages=64)
    engine.runner.cpu_threads.pressure = _Quiet()  # a busy test box must not turn the engine to one thread
    seen = _forward_thread_counts(engine)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _run(engine, "one")
        assert set(seen) == {1}
        torch.set_num_threads(2)
        _run(engine, "two")
        assert seen[-1] == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
