"""routed_experts / prompt_routed_experts on the wire: msgpack records, results files and pickles round-trip them
exactly (dtype included), records without them (older files) load with None, and every corrupt field is a
ValueError naming it."""
import pickle

import msgpack
import numpy as np
import pytest

from rollout_service.results.file import load_results, save_results
from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams


def routed(i: int = 0, dtype=np.uint8, layers: int = 3, k: int = 2) -> RolloutResult:
    rng = np.random.default_rng(i)
    prompt, n = rng.integers(0, 500, 6).tolist(), 4 + i
    top = 256 if dtype == np.uint8 else 1000
    return RolloutResult(
        request_id=f"r{i}", sample_index=0, prompt_token_ids=prompt, token_ids=rng.integers(0, 500, n).tolist(),
        logprobs=-rng.random(n).astype(np.float32), token_versions=[0] * n, finish_reason="length",
        routed_experts=rng.integers(0, top, (n, layers, k)).astype(dtype),
        prompt_routed_experts=rng.integers(0, top, (len(prompt) - 1, layers, k)).astype(dtype))


def same_routing(a: RolloutResult, b: RolloutResult) -> bool:
    return all(x.dtype == y.dtype and x.tobytes() == y.tobytes() and x.shape == y.shape
               for x, y in ((a.routed_experts, b.routed_experts), (a.prompt_routed_experts, b.prompt_routed_experts)))


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_msgpack_pickle_and_file_round_trips_are_exact(dtype, tmp_path):
    rs = [routed(i, dtype) for i in range(3)]
    for r in rs:
        back = RolloutResult.from_msgpack(r.to_msgpack())
        assert back == r and same_routing(back, r)
        assert same_routing(pickle.loads(pickle.dumps(r)), r)  # how results travel between Ray actors
    save_results(tmp_path / "f.msgpack", rs)
    assert all(same_routing(a, b) for a, b in zip(load_results(tmp_path / "f.msgpack"), rs))
    big = RolloutResult.from_msgpack(routed(0, dtype).to_msgpack()).routed_experts
    assert big.flags.writeable  # a copy, not a view of the record's bytes


def test_a_record_without_routing_loads_with_none():
    d = routed().to_dict()
    del d["routed_experts"], d["prompt_routed_experts"]
    back = RolloutResult.from_msgpack(msgpack.packb({"schema": 1, "kind": "result", **d}))
    assert back.routed_experts is None and back.prompt_routed_experts is None


def _record(**changes) -> bytes:
    d = routed().to_dict()
    for name, change in changes.items():
        field, key = name.split("__") if "__" in name else (name, None)
        if key is None:
            d[field] = change
        else:
            d[field] = {**d[field], key: change}
    return msgpack.packb({"schema": 1, "kind": "result", **d})


@pytest.mark.parametrize("changes,match", [
    ({"routed_experts": b"\x00\x01"}, r"routed_experts=.*must be None or a dict"),
    ({"routed_experts__dtype": "int64"}, r"routed_experts\['dtype'\].*must be one of"),
    ({"routed_experts__shape": [5, 3, 2]}, r"routed_experts\['shape'\].*must be \[4, moe_layers"),
    ({"routed_experts__shape": [4, 3]}, r"routed_experts\['shape'\]"),
    ({"routed_experts__shape": [4, 0, 2]}, r"routed_experts\['shape'\]"),
    ({"routed_experts__data": b"\x00" * 23}, r"routed_experts\['data'\].*must be 24 bytes"),
    ({"routed_experts__data": "text"}, r"routed_experts\['data'\]"),
    ({"prompt_routed_experts__shape": [6, 3, 2]}, r"prompt_routed_experts\['shape'\].*must be \[5, "),
    ({"prompt_routed_experts__shape": [5, 2, 3]}, r"prompt_routed_experts.*routed_experts' dtype, layers and top_k"),
])
def test_corrupt_routing_fields_name_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        RolloutResult.from_msgpack(_record(**changes))


@pytest.mark.parametrize("field,value,match", [
    ("routed_experts", np.zeros((3, 3, 2), np.uint8), r"routed_experts=.*must be None or a uint8 or uint16 array \[4,"),
    ("routed_experts", np.zeros((4, 3, 2), np.int32), r"routed_experts='int32 \(4, 3, 2\)'"),
    ("routed_experts", [[[1, 2]]] * 4, "routed_experts='list'"),
    ("prompt_routed_experts", np.zeros((6, 3, 2), np.uint8), r"prompt_routed_experts=.*array \[5,"),
    ("prompt_routed_experts", np.zeros((5, 3, 2), np.uint16), "routed_experts' dtype"),
])
def test_bad_routing_arrays_are_refused_when_the_result_is_made(field, value, match):
    r = routed()
    with pytest.raises(ValueError, match=match):
        RolloutResult(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, field: value})


def test_sampling_flags_are_checked_and_travel_with_the_request():
    with pytest.raises(ValueError, match="return_routed_experts=1: must be a bool"):
        SamplingParams(return_routed_experts=1)
    with pytest.raises(ValueError, match="return_prompt_routed_experts=True: needs return_routed_experts"):
        SamplingParams(return_prompt_routed_experts=True)
    req = RolloutRequest([1, 2], SamplingParams(return_routed_experts=True, return_prompt_routed_experts=True))
    back = RolloutRequest.from_msgpack(req.to_msgpack()).sampling
    assert back.return_routed_experts and back.return_prompt_routed_experts
