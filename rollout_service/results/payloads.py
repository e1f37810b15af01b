"""How results travel over Ray: a worker's poll returns two objects, small headers for the router and the results'
payload for the client, so the router keeps the book (exactly-once, staleness, resubmission) without unpickling
and re-pickling every result's tokens and log-probs.

- The worker packs the results of one poll (`pack`): one header per result, and one payload, a dict from the
  result's delivery group (the router's stream id, given with each job) to that group's results, pickled on
  their own so that a client decodes its own stream's results only.
- The router asks for the poll with two returns, reads the headers and keeps the payload's ObjectRef unread: it
  owns that object, which lives in the worker node's object store (or, when small, in the router's memory) and
  survives the worker's death, not its node's.
- The client's stream gets (ref, group, [(position, request_id, sample_index)]) batches and `unpack`s them. A
  payload whose node was lost before the client read it (ObjectLostError) comes back as lost samples, which the
  client reports on its next read; the router generates them again.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, NamedTuple

from rollout_service.api.types import RolloutResult


class Header(NamedTuple):
    """What the router needs of a result: its job and sample, why it ended, the oldest policy version among its
    tokens (None without tokens), and where it sits in the payload."""
    job_id: str
    sample_index: int
    finish_reason: str
    oldest_version: int | None
    group: str | None
    position: int


# a stream's share of one payload: (the payload's ObjectRef, its group, [(position, request_id, sample_index)])
Batch = tuple[Any, "str | None", list[tuple[int, str, int]]]


def pack(results: list[RolloutResult], group_of: Callable[[str], str | None]) -> tuple[list[Header], dict]:
    """Headers and payload of one poll's results; `group_of(job_id)`: the job's delivery group."""
    groups: dict[str | None, list[RolloutResult]] = {}
    headers = []
    for r in results:
        g = group_of(r.request_id)
        members = groups.setdefault(g, [])
        headers.append(Header(r.request_id, r.sample_index, r.finish_reason, oldest_version(r), g, len(members)))
        members.append(r)
    return headers, {g: _encode(rs) for g, rs in groups.items()}


def oldest_version(r: RolloutResult) -> int | None:
    """The oldest policy version among a result's tokens (None without tokens): what staleness is judged on."""
    return min(r.token_versions) if r.token_versions else None


def _encode(results: list[RolloutResult]) -> bytes:
    """Pickled; with Ray's cloudpickle when a result's metadata needs it (a lambda: clients may send any
    metadata that cloudpickle takes). pickle.loads reads both."""
    try:
        return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        from ray import cloudpickle
        return cloudpickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(batches: list[Batch]) -> tuple[list[RolloutResult], list[tuple[str, int]]]:
    """The results these batches name, each with its client's request id; and the (request_id, sample_index)
    of those whose payload is lost (its node died before it was read)."""
    import ray

    refs = list({id(b[0]): b[0] for b in batches}.values())
    payloads = _get_all(refs)
    decoded: dict[tuple[int, Any], list[RolloutResult]] = {}
    out, lost = [], []
    for ref, group, entries in batches:
        payload = payloads[id(ref)]
        if isinstance(payload, ray.exceptions.ObjectLostError):
            lost += [(rid, index) for _, rid, index in entries]
            continue
        key = (id(ref), group)
        if key not in decoded:
            decoded[key] = pickle.loads(payload[group])
        for position, rid, _ in entries:
            r = decoded[key][position]
            r.request_id = rid
            out.append(r)
    return out, lost


def _get_all(refs: list) -> dict[int, Any]:
    """id(ref) -> its payload, or the ObjectLostError that fetching it raised."""
    import ray

    try:
        return {id(r): p for r, p in zip(refs, ray.get(refs))}
    except ray.exceptions.ObjectLostError:
        pass
    out = {}
    for r in refs:  # one by one, to tell which are lost
        try:
            out[id(r)] = ray.get(r)
        except ray.exceptions.ObjectLostError as e:
            out[id(r)] = e
    return out
