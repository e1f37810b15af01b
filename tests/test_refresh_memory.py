"""A refresh storm with generation in flight leaves a CPU engine's resident memory flat after warm-up (issue 45,
item 5): freed KV pages are reused before untouched ones (engine/kv_cache.py), and the refresh's freed
temporaries go back to the OS (engine/heap.py). Before, each refresh's stale prefix-cache pages went to the back
of the free list, so new requests kept touching fresh pages of the pool until all of it was resident. With
on_refresh="recompute" the two oneDNN primitive caches grew it too, 159 MiB over 200 refreshes, until bounded."""
from __future__ import annotations

import threading

import pytest

from rollout_service import RolloutClient, SamplingParams
from rollout_service.engine.heap import release_freed_memory
from tiny_models import tiny_hf_model

NUM_PAGES = 24_000  # 2 layers x 2 (K, V) x 2 heads x 16 x 4 B x 16 tokens = 8 KiB a page: a 188 MiB pool
REFRESHES, WARM_UP = 300, 100  # 200 refreshes measured, after the warm-up
MAX_REFRESHES = 50 * REFRESHES  # generation that cannot finish two calls in these is stuck, not slow
CALL_SAMPLES = 16  # samples of one generate call: 4 prompts x n=4
MIB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


# Both modes: with "recompute" every refresh prefills every sequence in flight again at a new row count, and oneDNN
# keeps a primitive per row count; its two caches are bounded (ops/cpu_linear.py), and are full after WARM_UP.
@pytest.mark.parametrize("on_refresh", ["continue", "recompute"])
def test_resident_memory_stays_flat_over_a_refresh_storm_with_generation_in_flight(on_refresh):
    model = tiny_hf_model()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=48, ignore_eos=True)
    with RolloutClient.local(model, backend="torch", dtype="float32", device="cpu", num_pages=NUM_PAGES,
                             on_refresh=on_refresh) as client:
        stop, finished, errors = threading.Event(), [0], []

        def generate() -> None:
            try:
                while not stop.is_set():
                    finished[0] += len(client.generate([[1, 2, 3, 4, 5, 6, 7, 8] * 3] * (CALL_SAMPLES // sp.n), sp))
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        try:
            # At least REFRESHES refreshes, and on until two generate calls have finished after the warm-up: on a
            # busy machine the storm may outrun generation, and no clock says when it has caught up.
            version = warm = finished_at_warm = 0
            while version < REFRESHES or finished[0] < finished_at_warm + 2 * CALL_SAMPLES:
                version += 1
                assert version <= MAX_REFRESHES and not errors, (version, errors)
                client.update_weights(weights, version=version)
                if version == WARM_UP:
                    release_freed_memory()
                    warm, finished_at_warm = rss_bytes(), finished[0]
        finally:
            stop.set()
            thread.join(timeout=120)
        release_freed_memory()
        grown = rss_bytes() - warm
    assert not errors, errors
    assert finished[0] >= finished_at_warm + 2 * CALL_SAMPLES, "generation must have been in flight during the storm"
    # Touching the pool page by page would add up to its 188 MiB; the working set is a few hundred pages.
    assert grown < 24 * MIB, f"resident memory grew {grown / MIB:.1f} MiB over {version - WARM_UP} refreshes"
