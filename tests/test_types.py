"""SamplingParams validation and the msgpack wire format."""
import msgpack
import numpy as np
import pytest

from rollout_service.types import (RolloutRequest, RolloutResult, SamplingParams, load_results, save_results)


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
