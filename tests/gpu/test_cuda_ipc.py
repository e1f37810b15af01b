"""CUDA IPC buckets between two real processes: what the learner packs, a second process reads, bitwise,
and a refill of the same buckets is seen through the cached mapping (no re-allocation, no re-open)."""
import multiprocessing as mp

import pytest
import torch
from kv_utils import requires_cuda

from rollout_service.weights.buckets import named_items, plan
from rollout_service.weights.cuda_ipc import IpcSender

pytestmark = pytest.mark.skipif(**requires_cuda)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"a.weight": torch.randn(1000, 33, generator=g, device="cuda").bfloat16(),
            "b.weight": torch.randn(7, generator=g, device="cuda"),
            "c.bias": torch.randn(64, 64, generator=g, device="cuda").half(),
            "d.weight": torch.randn(3000, generator=g, device="cuda").bfloat16()}


def _reader(conn) -> None:
    """The worker side in another process: open the payloads it is sent, return host copies."""
    from rollout_service.weights.cuda_ipc import IpcReader
    reader = IpcReader()
    while (msg := conn.recv()) is not None:
        manifest, payload = msg
        views = reader.views(manifest, payload, torch.device("cuda", 0))
        conn.send(({n: t.cpu() for n, t in views}, len(reader._open)))
    reader.release()


def test_ipc_buckets_read_bitwise_by_another_process_and_reused():
    sender = IpcSender()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child,))
    proc.start()
    try:
        payloads = []
        for seed in (0, 1):  # the second refresh refills the same buckets
            items = named_items(_state(seed))
            manifest = plan(items, bucket_bytes=40_000)
            payload = sender.share(manifest, items)
            payloads.append(payload)
            parent.send((manifest, payload))
            got, opened = parent.recv()
            assert opened == 1
            assert len(manifest.bucket_sizes) > 1
            for name, t in items:
                assert got[name].dtype == t.dtype and torch.equal(got[name], t.cpu()), (seed, name)
        assert payloads[0]["buffers_id"] == payloads[1]["buffers_id"], "the buckets were re-allocated"
        parent.send(None)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
        sender.release()


def test_ipc_refuses_tensors_off_the_gpu():
    items = named_items({"a": torch.zeros(3), "b": torch.zeros(3, device="cuda")})
    with pytest.raises(ValueError, match="cuda_ipc.*one CUDA device"):
        IpcSender().share(plan(items), items)
