"""One engine serving requests in waves, the shared helper of the batch-invariant tests (CPU and GPU)."""
from rollout_service.api.types import RolloutRequest


def serve_in_waves(engine, requests, then=()) -> dict:
    """{(request index, sample index): result} of `engine` serving `requests` (prompt, sampling) together,
    then, once they are done, those of `then`, numbered on from the first ones; "stats": the engine's stats."""
    out, index = {}, 0
    for wave in (requests, then):
        for prompt, sp in wave:
            engine.add_request(RolloutRequest(prompt=prompt, sampling=sp, request_id=str(index)))
            index += 1
        out.update({(int(r.request_id), r.sample_index): r for r in engine.run_until_done()})
    out["stats"] = engine.stats()
    return out
