"""Prefix-aware routing through the Ray service, 2 CPU workers with real engines: turns of episodes driven by
the client (each turn a request whose prompt is the whole history) go back to the worker holding that history,
so the tokens prefilled stay within 1.2x the new tokens, as on one worker; by load alone they do not. Shapes are
W7's, scaled down (benchmarks/harness/prefix_routing.py measures the full ones)."""
from __future__ import annotations

import pytest

from benchmarks.harness.prefix_routing import Shape, conversations, measure
from rollout_service.client import RolloutClient
from rollout_service.config import ServiceConfig

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray
SHAPE = Shape(episodes=8, turns=3, prompt=64, obs=48, new=8, vocab=256)


def run(service_config, routing: str) -> dict:
    cfg = service_config(name=f"svc-routing-{routing}", routing=routing)
    cfg["engine"]["num_pages"] = 512
    with RolloutClient.launch(cfg) as client:
        return measure(client, lambda: conversations(client, SHAPE))


def test_turns_go_where_their_history_is_cached(ray_cluster, service_config):
    prefix, load = run(service_config, "prefix"), run(service_config, "load")
    assert prefix["prefilled_per_new"] <= 1.2, prefix
    assert prefix["routed"]["by_prefix"] == SHAPE.episodes * (SHAPE.turns - 1), prefix["routed"]
    assert all(h is not None and h > 0.3 for h in prefix["hit_rates"]), "both workers serve turns from cache"
    assert load["prefilled_per_new"] > 1.2 and load["routed"]["by_prefix"] == 0, load


def test_routing_is_checked_by_name():
    with pytest.raises(ValueError, match="ServiceConfig.routing='hash'.*one of \\('prefix', 'load'\\)"):
        ServiceConfig(routing="hash")
