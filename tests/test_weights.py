"""The bucket layout and the transport choice: exact packing for every dtype, buffers reused across
refreshes, NaN/inf named, and the `auto` rule with every explicit choice that cannot work refused."""
from __future__ import annotations

import pytest
import torch

from rollout_service.weights.buckets import (Buckets, named_items, pack, plan, reject_nonfinite, reuse_or_allocate,
                                             unpack, views)
from rollout_service.weights.transport import WorkerPlace, choose_transport, ipc_refusal


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(33, 7, generator=g),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(3, 3, generator=g).to(torch.float16),
        "d.scalar": torch.tensor(1.5, dtype=torch.float64),
        "e.empty": torch.empty(0, 4),
        "f.strided": torch.randn(8, 6, generator=g).t(),   # non-contiguous view
    }


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
def test_pack_unpack_is_exact(bucket_bytes):
    sd = _state()
    packed = pack(sd, bucket_bytes=bucket_bytes)
    out = dict(unpack(packed))
    assert list(out) == list(sd)
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v), k
    assert (len(packed.buckets) > 1) == (bucket_bytes < 1 << 20)
    assert all(e.offset % 64 == 0 for e in packed.entries)
    assert all(e.offset + e.nbytes <= packed.manifest.bucket_sizes[e.bucket] for e in packed.entries)


def test_buckets_are_reused_for_the_same_layout_and_refilled():
    a, b = named_items(_state(0)), named_items(_state(1))
    manifest = plan(a, bucket_bytes=256)
    assert plan(b, bucket_bytes=256) == manifest  # same names, shapes and dtypes: same layout
    first = reuse_or_allocate(None, manifest, "cpu")
    first.fill(a)
    second = reuse_or_allocate(first, plan(b, bucket_bytes=256), "cpu")
    assert second is first
    second.fill(b)
    assert all(torch.equal(t, dict(b)[n]) for n, t in views(manifest, second.buffers))
    other = plan(named_items({"x": torch.zeros(3)}), bucket_bytes=256)
    assert reuse_or_allocate(second, other, "cpu") is not second
    assert isinstance(reuse_or_allocate(None, other, "cpu"), Buckets)


def test_nonfinite_tensors_are_named():
    sd = _state()
    reject_nonfinite(named_items(sd))
    sd["c.bias"] = sd["c.bias"].clone()
    sd["c.bias"][1, 2] = float("nan")
    with pytest.raises(ValueError, match="'c.bias' holds NaN or inf"):
        reject_nonfinite(named_items(sd))
    sd["b.weight"] = torch.tensor([1.0, float("-inf")]).to(torch.bfloat16)
    with pytest.raises(ValueError, match="'b.weight' holds NaN or inf \\(and 1 more\\)"):
        reject_nonfinite(named_items(sd))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e5m2])  # (e4m3fn has no inf)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_one_nonfinite_element_anywhere_in_any_float_dtype_is_found(dtype, bad):
    big = torch.randn(1000, 77)
    reject_nonfinite([("w", big.to(dtype))])
    for at in (0, 41_234, 76_999):  # first, middle and last element
        t = big.clone()
        t.view(-1)[at] = bad
        with pytest.raises(ValueError, match="'w' holds NaN or inf"):
            reject_nonfinite([("ok", torch.ones(3)), ("w", t.to(dtype))])


def test_bad_named_tensors_are_refused():
    with pytest.raises(ValueError, match="no tensors"):
        pack({})
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        pack({"x": [1, 2]})
    with pytest.raises(ValueError, match="not a string"):
        named_items([(3, torch.zeros(1))])
    with pytest.raises(ValueError, match="iterable of \\(name, tensor\\) pairs"):
        named_items(5)
    with pytest.raises(ValueError, match="'x' is given twice"):
        named_items([("x", torch.zeros(1)), ("x", torch.ones(1))])
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan(named_items(_state()), bucket_bytes=0)


CPU_ITEMS = [("w", torch.zeros(2))]
NODE = "node-a"


class FakeCuda(torch.Tensor):
    """Only what choose_transport reads: the device (no CUDA here to make a real one)."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def places(*specs: tuple[str, str]) -> list[WorkerPlace]:
    return [WorkerPlace(i, node, dev) for i, (node, dev) in enumerate(specs)]


def test_auto_picks_ipc_then_broadcast_then_object_store():
    cuda_items = [("w", torch.zeros(2).as_subclass(FakeCuda))]
    gpus = places((NODE, "cuda:0"), (NODE, "cuda:0"))
    seeing = [WorkerPlace(w.index, w.node_id, w.device, (LEARNER_GPU,)) for w in gpus]
    assert choose_transport("auto", cuda_items, NODE, seeing, True, learner_gpu=LEARNER_GPU) == "cuda_ipc"
    assert choose_transport("auto", cuda_items, NODE, places((NODE, "cuda:0"), ("node-b", "cuda:0")), True) == "broadcast"
    assert choose_transport("auto", CPU_ITEMS, NODE, gpus, has_group=True) == "broadcast"
    assert choose_transport("auto", CPU_ITEMS, NODE, gpus, has_group=False) == "object_store"
    assert choose_transport("auto", cuda_items, NODE, places((NODE, "cpu")), has_group=False) == "object_store"
    assert choose_transport("object_store", cuda_items, NODE, gpus, has_group=True) == "object_store"


LEARNER_GPU, OTHER_GPU = "GPU-aaaa", "GPU-bbbb"


def test_cuda_ipc_reaches_only_workers_that_see_the_learners_gpu():
    """Ray shows a GPU worker its own GPU only: a worker on another GPU of the node cannot open the learner's
    buckets (it would map them as if on its own GPU), so auto does not pick CUDA IPC and asking for it is
    refused, naming the worker and what it sees. A worker that sees the learner's GPU (the colocated one, or
    one started with every GPU visible) is reached by peer access."""
    cuda_items = [("w", torch.zeros(2).as_subclass(FakeCuda))]
    colocated = WorkerPlace(0, NODE, "cuda:0", (LEARNER_GPU,))
    other_gpu = WorkerPlace(1, NODE, "cuda:0", (OTHER_GPU,))
    all_visible = WorkerPlace(1, NODE, "cuda:1", (LEARNER_GPU, OTHER_GPU))
    unreported = WorkerPlace(1, NODE, "cuda:0")
    assert ipc_refusal(cuda_items, NODE, LEARNER_GPU, [colocated, all_visible]) is None
    assert choose_transport("auto", cuda_items, NODE, [colocated, all_visible], False, LEARNER_GPU) == "cuda_ipc"
    for workers in ([colocated, other_gpu], [colocated, unreported]):
        assert choose_transport("auto", cuda_items, NODE, workers, True, LEARNER_GPU) == "broadcast"
        assert choose_transport("auto", cuda_items, NODE, workers, False, LEARNER_GPU) == "object_store"
    with pytest.raises(ValueError, match=f"learner's GPU \\({LEARNER_GPU}\\) visible to every worker; worker 1 runs "
                                         f"on another GPU and sees only {OTHER_GPU}. Use transport 'broadcast'"):
        choose_transport("cuda_ipc", cuda_items, NODE, [colocated, other_gpu], False, LEARNER_GPU)
    with pytest.raises(ValueError, match="worker 1 runs on another GPU and sees only no GPU it reported"):
        choose_transport("cuda_ipc", cuda_items, NODE, [colocated, unreported], False, LEARNER_GPU)


def test_a_worker_that_cannot_see_the_learners_gpu_refuses_the_handles():
    """The worker's own check (cuda_ipc._local_index): never a fallback to its own GPU's index."""
    from rollout_service.weights.cuda_ipc import _local_index, visible_gpus
    seen = visible_gpus()
    with pytest.raises(ValueError, match=f"learner's GPU {LEARNER_GPU} is not visible to this worker"):
        _local_index(LEARNER_GPU, torch.device("cuda", 0))
    if seen:  # (on a GPU machine: a visible GPU is found by its UUID)
        assert _local_index(seen[-1], torch.device("cuda", 0)) == len(seen) - 1


def test_explicit_transports_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="transport='nvlink'"):
        choose_transport("nvlink", CPU_ITEMS, NODE, [], False)
    with pytest.raises(ValueError, match="learner's node .*worker 1 runs on node node-b"):
        choose_transport("cuda_ipc", CPU_ITEMS, NODE, places((NODE, "cuda:0"), ("node-b", "cuda:0")), False)
    with pytest.raises(ValueError, match="GPU workers; worker 0 runs on cpu"):
        choose_transport("cuda_ipc", CPU_ITEMS, NODE, places((NODE, "cpu")), False)
    with pytest.raises(ValueError, match="one CUDA device \\(got cpu\\)"):
        choose_transport("cuda_ipc", CPU_ITEMS, NODE, places((NODE, "cuda:0")), False)
    with pytest.raises(ValueError, match="init_weight_group"):
        choose_transport("broadcast", CPU_ITEMS, NODE, places((NODE, "cpu")), has_group=False)
