"""SamplingParams validation, the msgpack wire format and results files."""
import re
import threading
import tracemalloc

import msgpack
import numpy as np
import pytest

from rollout_service.results.file import iter_results, load_results, save_results
from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams


def _result(i: int = 0, top: bool = True) -> RolloutResult:
    rng = np.random.default_rng(i)
    n = 5 + i
    return RolloutResult(
        request_id=f"req-{i}", sample_index=i % 3, prompt_token_ids=rng.integers(0, 50000, 7).tolist(),
        token_ids=rng.integers(0, 50000, n).tolist(), logprobs=-rng.random(n).astype(np.float32) * 7,
        token_versions=[3] * (n - 2) + [4, 4], finish_reason="length", text="héllo ✓",
        top_logprobs=[{int(a): float(b) for a, b in zip(rng.integers(0, 9, 2), -rng.random(2))} for _ in range(n)]
        if top else None,
        reward=0.5, metadata={"answer": "42", "nested": [1, 2.5, None]}, timings={"queued": 1.0, "finished": 2.5})


@pytest.mark.parametrize("i", range(4))
def test_result_round_trip_is_exact(i):
    r = _result(i, top=i % 2 == 0)
    back = RolloutResult.from_msgpack(r.to_msgpack())
    assert back == r
    assert back.logprobs.dtype == np.float32
    assert back.logprobs.tobytes() == r.logprobs.tobytes()  # bit-exact, not just close
    assert back.token_ids == r.token_ids and back.top_logprobs == r.top_logprobs and back.metadata == r.metadata


def test_request_round_trip():
    req = RolloutRequest(prompt=[{"role": "user", "content": "hi"}], sampling=SamplingParams(n=4, seed=7, stop=["\n"]),
                         metadata={"gt": 3})
    back = RolloutRequest.from_msgpack(req.to_msgpack())
    assert back.to_dict() == req.to_dict()


@pytest.mark.parametrize("data", [b"", b"\xc1\xc1", b"\x93\x01\x02", msgpack.packb({"schema": 1, "kind": "result"}),
                                  msgpack.packb({"schema": 99, "kind": "result"}), "not bytes"])
def test_corrupt_bytes_raise_clear_error(data):
    with pytest.raises(ValueError, match="result|msgpack"):
        RolloutResult.from_msgpack(data)


def test_truncated_array_field_raises():
    d = _result().to_dict()
    d["token_ids"] = d["token_ids"][:-1]
    with pytest.raises(ValueError, match="4-byte"):
        RolloutResult.from_msgpack(msgpack.packb({"schema": 1, "kind": "result", **d}))


def test_batch_file_codec(tmp_path):
    results = [_result(i) for i in range(5)]
    path = tmp_path / "out.msgpack"
    assert save_results(path, results) == 5
    assert load_results(path) == results
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError):
        load_results(path)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("temperature", float("nan")), ("top_k", 0), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", -1), ("frequency_penalty", 3), ("presence_penalty", -2.5), ("repetition_penalty", 0),
    ("max_tokens", 0), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", -1), ("logprobs", 21),
    ("logprobs_mode", "bogus"), ("ignore_eos", "yes"), ("n", 1.5),
])
def test_bad_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("prompt", ["", [], [1, -2], [{"role": "user"}], 5, None])
def test_bad_prompts_rejected(prompt):
    with pytest.raises(ValueError, match="prompt"):
        RolloutRequest(prompt=prompt)


def test_result_error_round_trips_and_old_records_load_without_it():
    failed = RolloutResult("r", 0, [1, 2], [3], [-0.5], [2], "abort", error="IndexError: index out of range")
    assert RolloutResult.from_msgpack(failed.to_msgpack()).error == "IndexError: index out of range"
    old = _result().to_dict()
    del old["error"]  # a record written before the field existed (same schema version)
    assert RolloutResult.from_msgpack(msgpack.packb({"schema": 1, "kind": "result", **old})).error is None
    with pytest.raises(ValueError, match="RolloutResult.error"):
        RolloutResult("r", 0, [1], [3], [-0.5], [2], "length", error="an error on a finished result")


def test_numpy_values_are_plain_numbers_on_the_wire():
    sp = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), stop_token_ids=[np.int32(7)], seed=np.uint64(3))
    req = RolloutRequest([np.int64(3), np.int64(4)], sp)
    back = RolloutRequest.from_msgpack(req.to_msgpack())
    assert back.to_dict() == req.to_dict() and type(back.sampling.n) is int and back.prompt == [3, 4]


# -- results files: truncation, corruption, size, field types ---------------------------------------------
def _episode_result() -> RolloutResult:
    """A result with every optional field set (an episode's: loss mask, turns; an error text)."""
    return RolloutResult("ep", 1, [1, 2], [5, 6, 7, 8], [-0.5, 0.0, 0.0, -1.5], [2, 2, 2, 3], "abort",
                         text="", top_logprobs=[{5: -0.5}, {}, {}, {8: -1.5, 9: -2.0}], reward=1.0,
                         metadata={1: "int keys"}, timings={"queued": 1.0}, error="env failed",
                         reward_error=None, loss_mask=[1, 0, 0, 1],
                         turns=[{"start": 0, "end": 1, "version": 2, "finish_reason": "stop", "reward": 0.5},
                                {"start": 3, "end": 4, "version": 3, "finish_reason": "abort", "reward": None}])


def _record_starts(results: list[RolloutResult]) -> list[int]:
    """Byte offsets of the header, each result and the end record of a file save_results writes."""
    starts = [0, len(msgpack.packb({"schema": 1, "kind": "results_file"}))]
    for r in results:
        starts.append(starts[-1] + len(r.to_msgpack()))
    return starts


def test_every_cut_point_of_a_file_is_an_error_naming_the_offset(tmp_path):
    results = [_result(0), _episode_result(), _result(2, top=False)]
    path = tmp_path / "out.msgpack"
    save_results(path, results)
    data = path.read_bytes()
    starts = _record_starts(results)
    assert load_results(path) == results and starts[-1] < len(data)
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError) as e:
            load_results(path)
        at = max(s for s in starts if s <= cut)  # the record the cut falls in (or the one missing from there)
        expected = "empty file" if cut == 0 else f"byte offset {at}"
        assert expected in str(e.value) and str(path) in str(e.value), (cut, str(e.value))


def test_corrupt_files_name_the_offset(tmp_path):
    results = [_result(i) for i in range(3)]
    path = tmp_path / "out.msgpack"
    save_results(path, results)
    data, starts = path.read_bytes(), _record_starts(results)
    header = len(msgpack.packb({"schema": 1, "kind": "results_file"}))
    end = msgpack.packb({"schema": 1, "kind": "end", "count": 3})
    cases = [
        (data[:starts[2]] + b"\xc1" + data[starts[2] + 1:], f"corrupt at byte offset {starts[2]}: not msgpack"),
        (data + b"\x00", f"data after the end record, at byte offset {len(data)}"),
        (data + data[header:], f"data after the end record, at byte offset {len(data)}"),
        (data[:starts[4]] + msgpack.packb({"schema": 1, "kind": "end", "count": 4}),
         f"end record at byte offset {starts[4]} counts 4 results, but the file holds 3"),
        (msgpack.packb({"kind": "something"}) + data[header:], "not a results file"),
        (data[:header] + msgpack.packb([1, 2]) + end, f"result 0 at byte offset {header}: msgpack payload is not a result"),
    ]
    for bad, match in cases:
        path.write_bytes(bad)
        with pytest.raises(ValueError, match=match):
            load_results(path)


def test_files_without_header_still_load(tmp_path):
    """Files written before the header and end records existed: the results' records, one after another."""
    results = [_result(i) for i in range(3)]
    path = tmp_path / "old.msgpack"
    data = b"".join(r.to_msgpack() for r in results)
    path.write_bytes(data)
    assert load_results(path) == results
    path.write_bytes(data[:-1])  # a cut inside a record is seen; one between two records cannot be
    with pytest.raises(ValueError, match=f"the record at byte offset {len(data) - len(results[2].to_msgpack())}"):
        load_results(path)


def test_empty_and_iterated(tmp_path):
    path = tmp_path / "none.msgpack"
    assert save_results(path, iter([])) == 0 and load_results(path) == []
    assert save_results(path, (_result(i) for i in range(4))) == 4
    assert [r.request_id for r in iter_results(path)] == [f"req-{i}" for i in range(4)]


def _big_result(i: int, tokens: int) -> RolloutResult:
    ids = (np.arange(tokens) % 251).tolist()  # small ints: Python shares their objects, the lists stay cheap
    return RolloutResult(f"big-{i}", 0, [1, 2, 3], ids, np.full(tokens, -0.25 * i, np.float32), [i] * tokens,
                         "length", metadata={"i": i})


def test_a_file_over_100_mib_streams_back(tmp_path):
    """msgpack's default buffer is 100 MiB: a file above that loads, read in chunks, never held whole."""
    count, tokens = 40, 270_000  # 40 records of 3.2 MB: 130 MB in all
    path = tmp_path / "big.msgpack"
    try:
        assert save_results(path, (_big_result(i, tokens) for i in range(count))) == count
        size = path.stat().st_size
        assert size > 105 * 2**20
        tracemalloc.start()
        try:
            seen = [r.request_id for r in iter_results(path)]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert seen == [f"big-{i}" for i in range(count)]
        assert peak < size / 4, f"iterating a {size / 2**20:.0f} MiB file held {peak / 2**20:.0f} MiB at its peak"
        back = load_results(path)
        assert len(back) == count and all(r == _big_result(i, tokens) for i, r in enumerate(back))
    finally:
        path.unlink(missing_ok=True)


def _wire(result: RolloutResult, **fields) -> bytes:
    return msgpack.packb({"schema": 1, "kind": "result", **result.to_dict(), **fields})


BAD_FIELDS = [
    ("reward", "high"), ("reward", float("nan")), ("reward", True), ("loss_mask", ["a", "b", "c", "d"]),
    ("loss_mask", bytes([0, 1, 2, 1])), ("loss_mask", bytes([1, 1])), ("sample_index", -1), ("sample_index", "0"),
    ("request_id", 5), ("text", None), ("finish_reason", "done!"), ("timings", {"queued": "noon"}),
    ("timings", [1.0]), ("error", 3), ("reward_error", b"bytes"), ("token_ids", b"\xff\xff\xff\xff" * 4),
    ("token_versions", b"\x00" * 12), ("logprobs", b"\x00" * 12), ("logprobs", [0.0] * 4),
    ("prompt_token_ids", [1, 2]), ("top_logprobs", [[[5], [-0.5]]]), ("top_logprobs", [[[5], ["x"]]] * 4),
    ("top_logprobs", [[[5, 6], [-0.5]]] * 4), ("top_logprobs", [{"5": -0.5}] * 4), ("top_logprobs", [[[-5], [0.0]]] * 4),
    ("turns", [{"start": 0, "end": 9, "version": 0}]), ("turns", [{"start": 0, "end": 1}]),
    ("turns", [{"start": 0, "end": 1, "version": 0, "reward": "good"}]), ("turns", {"start": 0}),
    ("no_such_field", 1),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r:.20}" for f, v in BAD_FIELDS])
def test_field_types_are_checked_on_load(tmp_path, field, value):
    good = _episode_result()
    bad = _wire(good, **{field: value})
    name = "unknown field" if field == "no_such_field" else f"RolloutResult.{field}"
    with pytest.raises(ValueError, match=re.escape(name)):
        RolloutResult.from_msgpack(bad)
    path = tmp_path / "bad.msgpack"
    save_results(path, [good])
    data = path.read_bytes()
    first = _record_starts([good])[1]
    second = first + len(good.to_msgpack())
    end = data[second:]
    path.write_bytes(data[:second] + bad + end)
    with pytest.raises(ValueError, match=f"result 1 at byte offset {second}: .*{re.escape(name)}"):
        load_results(path)
    assert next(iter_results(path)) == good  # the good record before it was read


@pytest.mark.parametrize("field,value,match", [
    ("reward", "high", "RolloutResult.reward='high': must be None or a finite number"),
    ("loss_mask", ["a", "b", "c", "d"], "RolloutResult.loss_mask: cannot be encoded"),
    ("loss_mask", [0, 2, 0, 1], "RolloutResult.loss_mask=.*: must be None or one 0/1 byte per token"),
    ("token_ids", [1, 2, 3, 2**31], "RolloutResult.token_ids: cannot be encoded"),
    ("top_logprobs", [{5: "x"}] * 4, "RolloutResult.top_logprobs: cannot be encoded"),
    ("timings", {"queued": None}, "RolloutResult.timings"),
    ("metadata", {"lock": threading.Lock()}, "RolloutResult.metadata: cannot be encoded as msgpack"),
    ("metadata", "lone \ud800", "RolloutResult.metadata: cannot be encoded as msgpack"),
    ("metadata", {"ok": [{(1, 2): "a"}]}, r"RolloutResult.metadata: has the tuple \(1, 2\) as a dict key"),
])
def test_a_result_that_would_not_load_back_is_not_saved(tmp_path, field, value, match):
    path = tmp_path / "out.msgpack"
    save_results(path, [_result(0)])
    before = path.read_bytes()
    bad = _episode_result()
    setattr(bad, field, value)
    with pytest.raises(ValueError, match=match):
        bad.to_msgpack()
    with pytest.raises(ValueError, match=f"save_results: result 1 \\(request 'ep'\\): {match}"):
        save_results(path, [_result(1), bad, _result(2)])
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["out.msgpack"]


def test_error_texts_with_lone_surrogates_are_saved(tmp_path):
    """Exception messages may hold lone surrogates (bytes decoded with surrogateescape): they are saved as
    backslash escapes, not refused."""
    failed = RolloutResult("r", 0, [1], [3], [-0.5], [2], "abort", error="OSError: bad name b'\udcff'")
    scored = _result(1)
    scored.reward, scored.reward_error = None, "ValueError: \ud800 is not a digit"
    path = tmp_path / "out.msgpack"
    assert save_results(path, [failed, scored]) == 2
    back = load_results(path)
    assert back[0].error == "OSError: bad name b'\\udcff'" and back[1].reward_error == "ValueError: \\ud800 is not a digit"
    assert RolloutResult.from_msgpack(failed.to_msgpack()).error == back[0].error
