"""Which router of several a request goes to (rollout_service/connections/request_shards.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.connections.request_shards import split

PROMPTS = [[1 + i % 7, 2 + i, 3 + i * i % 251] for i in range(1000)]


def test_the_same_prompt_goes_to_the_same_router_in_every_form():
    reqs = [RolloutRequest(p, SamplingParams(seed=i)) for i, p in enumerate(PROMPTS[:50])]
    as_objects = split(reqs, 4)
    as_dicts = split([r.to_dict() for r in reqs], 4)
    as_bytes = split([r.to_msgpack() for r in reqs], 4)
    assert as_objects == as_dicts == as_bytes
    again = split([RolloutRequest(p, SamplingParams(n=8)) for p in PROMPTS[:50]], 4)  # other ids and params
    assert again == as_objects


def test_a_session_stays_on_one_router_while_its_prompt_grows():
    turns = [RolloutRequest(PROMPTS[0] + list(range(5, 5 + k)), metadata={"session_id": "episode-3"}) for k in range(40)]
    assert len(split(turns, 4)) == 1
    assert len(split([RolloutRequest(t.prompt) for t in turns], 4)) > 1  # without it the prompts spread


def test_many_prompts_spread_evenly():
    for routers in (2, 4):
        counts = [len(v) for v in split([RolloutRequest(p) for p in PROMPTS], routers).values()]
        assert len(counts) == routers and max(counts) < 1.25 * len(PROMPTS) / routers, counts


def test_every_process_routes_alike():
    """Python's str hash is salted per process; the routing must not be (a client that connects later)."""
    code = ("import json; from rollout_service.api.types import RolloutRequest as R; "
            "from rollout_service.connections.request_shards import split; "
            "print(json.dumps(split([R([1, 2, i], metadata={'session_id': f's{i}'}) for i in range(64)], 4)))")
    out = [json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                     env={**os.environ, "PYTHONHASHSEED": seed}).stdout) for seed in ("1", "2")]
    assert out[0] == out[1] and len(out[0]) == 4


def test_unreadable_items_still_get_a_router():
    parts = split([b"\xc1 not msgpack", {"prompt": object()}, 17, RolloutRequest([1, 2])], 3)
    assert sorted(i for v in parts.values() for i in v) == [0, 1, 2, 3]
