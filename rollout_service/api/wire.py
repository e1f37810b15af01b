"""RolloutResult's msgpack wire format: field conversions and the checks that every record is what it claims,
each failure a ValueError naming the field (rollout_service/api/types.py builds the objects; results/file.py
streams records to and from files). Arrays travel as raw little-endian bytes; never pickle.
"""
from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any, Iterable

import msgpack
import numpy as np

from rollout_service.api.values import MAX_INT32, is_int, is_number, is_real

# "done" and "max_turns" end multi-turn episodes (the environment said done / the turn limit was reached)
# "scored": a given completion's teacher-forced log-probs (RolloutRequest.completion)
FINISH_REASONS = ("stop", "length", "abort", "done", "max_turns", "scored")
WIRE_SCHEMA_VERSION = 1


def reject_unknown(d: Mapping, known: set[str], what: str) -> None:
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {sorted(map(str, unknown))}; known: {sorted(known)}")


def to_i32(xs: Iterable[int]) -> bytes:
    return np.asarray(list(xs), dtype="<i4").tobytes()


def from_i32(b: bytes) -> list[int]:
    return np.frombuffer(b, dtype="<i4").tolist()


def _plain(v: Any) -> Any:
    """numpy scalars as the Python numbers msgpack packs."""
    return v.item() if isinstance(v, (np.integer, np.floating)) else v


def _encodable(text: Any) -> Any:
    """An error text as UTF-8 can carry it: exception messages may hold lone surrogates (from bytes decoded
    with surrogateescape, say), which msgpack refuses; they are written as backslash escapes."""
    if not isinstance(text, str):
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def tuple_key(value: Any) -> Any:
    """A tuple used as a dict key anywhere in `value` (None if there is none)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, tuple):
                    return k
                stack.append(x)
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return None


def _top_to_wire(top: Any) -> Any:
    if top is None:
        return None
    return [[[_plain(t) for t in d.keys()], [float(v) for v in d.values()]] for d in top]


ROUTING_DTYPES = ("uint8", "uint16")  # expert ids: uint8 while a model has at most 256 experts per layer
ROUTING_FIELDS = ("routed_experts", "prompt_routed_experts")


def _routing_to_wire(ids: Any) -> Any:
    if ids is None:
        return None
    ids = np.asarray(ids)
    if ids.dtype.name not in ROUTING_DTYPES:
        raise ValueError(f"expert ids of dtype {ids.dtype.name}: must be {' or '.join(ROUTING_DTYPES)}")
    return {"dtype": ids.dtype.name, "shape": list(ids.shape), "data": ids.astype(ids.dtype.newbyteorder("<")).tobytes()}


def routing_from_wire(d: Any) -> np.ndarray | None:
    """An expert-id array from its wire form ({"dtype", "shape", "data": little-endian bytes}), checked before."""
    if d is None:
        return None
    wire = np.dtype(d["dtype"]).newbyteorder("<")
    return np.frombuffer(d["data"], dtype=wire).astype(d["dtype"]).reshape(d["shape"])


def checked_routing(ids: Any, name: str, rows: int) -> np.ndarray | None:
    """ids (None, or an expert-id array [rows, moe_layers, top_k] of uint8 / uint16) as the result holds it;
    ValueError naming the field otherwise."""
    if ids is None:
        return None
    ok = isinstance(ids, np.ndarray) and ids.dtype.name in ROUTING_DTYPES and ids.ndim == 3
    need(ok and ids.shape[0] == rows and min(ids.shape[1:]) >= 1, name,
         f"must be None or a {' or '.join(ROUTING_DTYPES)} array [{rows}, moe_layers >= 1, top_k >= 1]",
         f"{ids.dtype} {ids.shape}" if isinstance(ids, np.ndarray) else type(ids).__name__)
    return ids


def _check_routing_record(d: Mapping, n: int) -> None:
    """The routed_experts fields of a record: [tokens (prompt tokens - 1 for the prompt's), layers, k] each, in
    the same dtype and [layers, k] when both are there."""
    prompt_rows = max(0, _check_ids(d, "prompt_token_ids") - 1)
    seen = []
    for name, rows in zip(ROUTING_FIELDS, (n, prompt_rows)):
        v = d.get(name)
        if v is None:
            continue
        need(isinstance(v, dict) and set(v) == {"dtype", "shape", "data"}, name,
             "must be None or a dict with 'dtype', 'shape' and 'data'", v)
        shape, data = v["shape"], v["data"]
        need(v["dtype"] in ROUTING_DTYPES, f"{name}['dtype']", f"must be one of {ROUTING_DTYPES}", v["dtype"])
        need(isinstance(shape, list) and len(shape) == 3 and all(is_int(x) and 0 <= x <= MAX_INT32 for x in shape)
             and shape[0] == rows and min(shape[1:]) >= 1, f"{name}['shape']",
             f"must be [{rows}, moe_layers >= 1, top_k >= 1]", shape)
        size = shape[0] * shape[1] * shape[2] * np.dtype(v["dtype"]).itemsize
        need(isinstance(data, (bytes, bytearray)) and len(data) == size, f"{name}['data']",
             f"must be {size} bytes ({v['dtype']} values of shape {shape}, little-endian)", data)
        seen.append((v["dtype"], shape[1:]))
    need(len(set(map(str, seen))) <= 1, "prompt_routed_experts", "must have routed_experts' dtype, layers and top_k",
         seen)


TO_WIRE = {
    "request_id": lambda v: v, "sample_index": _plain,
    "prompt_token_ids": to_i32, "token_ids": to_i32,
    "logprobs": lambda v: np.asarray(v).astype("<f4").tobytes(), "token_versions": to_i32,
    "finish_reason": lambda v: v, "text": lambda v: v, "top_logprobs": _top_to_wire, "reward": _plain,
    "metadata": lambda v: v, "timings": lambda v: {k: _plain(x) for k, x in dict(v).items()},
    "error": _encodable, "reward_error": _encodable,
    "loss_mask": lambda v: None if v is None else bytes(v),
    "turns": lambda v: None if v is None else [{k: _plain(x) for k, x in t.items()} for t in v],
    "routed_experts": _routing_to_wire, "prompt_routed_experts": _routing_to_wire,
    "kv_versions": lambda v: None if v is None else to_i32(v), "receipt": lambda v: v,
}
# absent from records written before they existed
_RESULT_OPTIONAL = {"error", "reward_error", "loss_mask", "turns", *ROUTING_FIELDS, "kv_versions", "receipt"}
_RESULT_REQUIRED = set(TO_WIRE) - _RESULT_OPTIONAL
SHORT = reprlib.Repr()
SHORT.maxstring = SHORT.maxother = 80


_UNSHOWN = object()


def need(ok: bool, name: str, why: str, value: Any = _UNSHOWN) -> None:
    if not ok:
        shown = "" if value is _UNSHOWN else f"={SHORT.repr(value)}"
        raise ValueError(f"RolloutResult.{name}{shown}: {why}")




def _check_ids(d: Mapping, name: str) -> int:
    """Number of values of a little-endian int32 array field, each checked to be >= 0."""
    b = d[name]
    need(isinstance(b, (bytes, bytearray)) and len(b) % 4 == 0, name,
          "must be int32 bytes (a whole number of 4-byte little-endian values)", b)
    values = np.frombuffer(b, dtype="<i4")
    if len(values) and values.min() < 0:
        raise ValueError(f"RolloutResult.{name}: value {int(values.min())} is negative")
    return len(values)


def _check_top(top: Any, n: int) -> None:
    need(isinstance(top, list) and len(top) == n, "top_logprobs",
          f"must be None or a list of one [token ids, log-probs] pair per token ({n})", top)
    for i, entry in enumerate(top):
        ok = (isinstance(entry, (list, tuple)) and len(entry) == 2 and all(isinstance(x, list) for x in entry)
              and len(entry[0]) == len(entry[1]))
        need(ok, f"top_logprobs[{i}]", "must be [token ids, log-probs], two lists of equal length", entry)
        need(all(is_int(t) and 0 <= t <= MAX_INT32 for t in entry[0]), f"top_logprobs[{i}]",
              "token ids must be ints in [0, 2**31)", entry[0])
        need(all(is_number(v) for v in entry[1]), f"top_logprobs[{i}]", "log-probs must be numbers", entry[1])


def _check_turns(turns: Any, n: int) -> None:
    need(isinstance(turns, list), "turns", "must be None or a list of dicts, one per model turn", turns)
    for i, t in enumerate(turns):
        what = f"turns[{i}]"
        need(isinstance(t, dict) and {"start", "end", "version"} <= t.keys(), what,
              "must be a dict with int 'start', 'end' and 'version'", t)
        need(all(is_int(t[k]) for k in ("start", "end", "version")) and 0 <= t["start"] <= t["end"] <= n
              and 0 <= t["version"] <= MAX_INT32, what,
              f"'start' <= 'end' must span token_ids ({n} tokens), 'version' an int in [0, 2**31)", t)
        need(isinstance(t.get("finish_reason", ""), str), f"{what}['finish_reason']", "must be a str",
              t.get("finish_reason"))
        need(t.get("reward") is None or is_number(t["reward"]), f"{what}['reward']", "must be None or a number",
              t.get("reward"))


def check_result_record(d: Any) -> None:
    """ValueError naming the first field of a result record (wire form) whose type or range is wrong."""
    if not isinstance(d, Mapping):
        raise ValueError(f"RolloutResult: expected a dict of fields, got {type(d).__name__}")
    missing = sorted(_RESULT_REQUIRED - d.keys())
    if missing:
        raise ValueError(f"RolloutResult: the result record lacks field(s) {missing}")
    reject_unknown(d, set(TO_WIRE) | {"schema", "kind"}, "RolloutResult")
    need(isinstance(d["request_id"], str), "request_id", "must be a str", d["request_id"])
    need(is_int(d["sample_index"]) and 0 <= d["sample_index"] <= MAX_INT32, "sample_index",
          "must be an int in [0, 2**31)", d["sample_index"])
    _check_ids(d, "prompt_token_ids")
    n = _check_ids(d, "token_ids")
    need(_check_ids(d, "token_versions") == n, "token_versions", f"must have one entry per token ({n})")
    lp = d["logprobs"]
    need(isinstance(lp, (bytes, bytearray)) and len(lp) == 4 * n, "logprobs",
          f"must be float32 bytes, one 4-byte little-endian value per token ({n})", lp)
    reason = d["finish_reason"]
    need(isinstance(reason, str) and reason in FINISH_REASONS, "finish_reason", f"must be one of {FINISH_REASONS}",
          reason)
    need(isinstance(d["text"], str), "text", "must be a str", d["text"])
    if d["top_logprobs"] is not None:
        _check_top(d["top_logprobs"], n)
    need(d["reward"] is None or is_real(d["reward"]), "reward", "must be None or a finite number", d["reward"])
    t = d["timings"]
    need(isinstance(t, dict) and all(isinstance(k, str) and is_number(v) for k, v in t.items()), "timings",
          "must be a dict of str -> number (seconds)", t)
    for name in ("error", "reward_error"):
        need(d.get(name) is None or isinstance(d[name], str), name, "must be None or a str", d.get(name))
    mask = d.get("loss_mask")
    if mask is not None:
        need(isinstance(mask, (bytes, bytearray)) and len(mask) == n and set(mask) <= {0, 1}, "loss_mask",
              f"must be None or one 0/1 byte per token ({n})", mask)
    if d.get("turns") is not None:
        _check_turns(d["turns"], n)
    if d.get("kv_versions") is not None:
        need(_check_ids(d, "kv_versions") == n, "kv_versions", f"must be None or have one entry per token ({n})")
        kv, tv = np.frombuffer(d["kv_versions"], "<i4"), np.frombuffer(d["token_versions"], "<i4")
        need(bool((kv <= tv).all()), "kv_versions", "a token's KV cannot be newer than the policy that sampled it")
    receipt = d.get("receipt")
    need(receipt is None or (isinstance(receipt, str) and len(receipt) == 64), "receipt",
         "must be None or a sha256 hex digest (64 characters)", receipt)
    _check_routing_record(d, n)


def packb(record: dict, what: str = "record field ") -> bytes:
    """msgpack bytes of a record; ValueError naming (after `what`) the field that msgpack cannot encode."""
    try:
        return msgpack.packb(record)
    except Exception:  # TypeError (an object msgpack knows nothing of), UnicodeEncodeError, OverflowError, ...
        for name, value in record.items():
            try:
                msgpack.packb(value)
            except Exception as e:
                raise ValueError(f"{what}{name}: cannot be encoded as msgpack ({type(e).__name__}: {e})") from None
        raise


def unpack_record(data: bytes, kind: str) -> dict:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"expected msgpack bytes for a {kind}, got {type(data).__name__}")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise ValueError(f"corrupt msgpack {kind}: {type(e).__name__}: {e}") from None
    return check_record(d, kind)


def check_record(d: Any, kind: str) -> dict:
    if not isinstance(d, dict) or d.get("kind") != kind:
        raise ValueError(f"msgpack payload is not a {kind} record")
    if d.get("schema") != WIRE_SCHEMA_VERSION:
        raise ValueError(f"unsupported {kind} schema version {d.get('schema')!r} (expected {WIRE_SCHEMA_VERSION})")
    return d
