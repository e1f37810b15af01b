"""Delta refresh encoding, no Ray: gap-coded positions, the dense-or-sparse choice per bucket, a chain of deltas
bit for bit equal to a dense cast, corrupt deltas refused before anything is written, the learner's rules for
`delta=`, and the in-process client validating `delta` as the Ray one does."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout_service.weights.buckets import Buckets, named_items, plan
from rollout_service.weights.delta import (BucketCode, DeltaPlan, SKIP, apply, code_count, decode, decode_positions,
                                           encode, encode_positions)
from rollout_service.weights.delta_sender import (PROBE_EVERY, DeltaSender, PushPace, check_delta, delta_dtype,
                                                 delta_refusal)
from rollout_service.weights.delta_values import _from_ordered, decode_values, encode_values, ordered, values_nbytes
from delta_states import before_and_after
from tiny_models import tiny_hf_model

BF16 = torch.bfloat16


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(300, 64, generator=g) * 0.02, "norm.weight": torch.ones(64),
            "proj.weight": torch.randn(128, 64, generator=g) * 0.02, "scalar": torch.tensor(0.5),
            "empty": torch.empty(0, 3), "strided": torch.randn(40, 30, generator=g).t()}


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An update of size ~lr on every element: most round back to the same bf16."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + lr * torch.randn(v.shape, generator=g) for k, v in state.items()}


def _as_bf16(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(BF16) for k, v in state.items()}


def _base(state, bucket_bytes: int = 4096) -> tuple:
    items = named_items(state)
    manifest = plan(items, bucket_bytes, BF16)
    base = Buckets(manifest)
    base.fill(items)
    return manifest, base


@pytest.mark.parametrize("width", [1, 2])
def test_positions_round_trip_with_escapes_at_both_ends(width):
    numel = 3 * SKIP[width] + 1000
    for index in ([0], [numel - 1], [0, 1, 2, numel - 1], [SKIP[width] - 1, SKIP[width], 3 * SKIP[width] + 7],
                  [SKIP[width] - 1, 2 * SKIP[width] - 1],  # gaps of exactly SKIP: the largest that need no escape
                  sorted(torch.randperm(numel)[:200].tolist()), []):
        index = torch.tensor(index, dtype=torch.int64)
        codes = encode_positions(index, width)
        assert codes.dtype == torch.uint8 and codes.numel() == code_count(index, width) * width
        assert torch.equal(decode_positions(codes, width, index.numel(), numel, "w"), index)


def test_values_go_as_one_byte_steps_across_zero_and_escape_far_moves_exactly():
    g = torch.Generator().manual_seed(4)
    old = (torch.randn(1000, generator=g) * 0.02).to(BF16)
    old[:4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    ulp = old.view(torch.int16) + torch.randint(-3, 4, (1000,), generator=g).to(torch.int16)
    new = ulp.view(BF16).clone()  # (bits +-3: within a sign's values, a few ulps)
    new[:4] = torch.tensor([-0.0, 1e-38, -1e-30, 0.5])  # across zero (adjacent or far), and far moves
    data, steps, raws = encode_values(new, old)
    assert steps and 1 <= raws <= 3 and data.numel() == values_nbytes(1000, 2, True, raws) < 2000
    got = decode_values(data, 1000, BF16, True, raws, old)
    assert torch.equal(got.view(torch.int16), new.view(torch.int16))
    assert "escape to" in decode_values(data, 1000, BF16, True, raws + 1, old)
    top = torch.tensor([32767], dtype=torch.int16).view(BF16)  # (the last bit pattern: one step past it is none)
    one = torch.tensor([1], dtype=torch.int8).view(torch.uint8)
    assert decode_values(one, 1, BF16, True, 0, top) == "a step leaves the dtype's values"
    raw, steps, _ = encode_values(new.float(), old.float())  # fp32 moves span many ulps: raw
    assert not steps and raw.numel() == 4000


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_a_step_counts_the_representable_values_between_two_floats(dtype):
    """Every 16-bit pattern's ordered value follows the float order (-0.0 just below 0.0), and each finite value
    is one step from the next larger one: a step of k moves exactly k representable values."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = patterns[torch.isfinite(patterns)]
    by_value = finite[torch.argsort(finite.float(), stable=True)]
    order = ordered(by_value).long()
    zero = (by_value == 0).nonzero().reshape(-1)
    assert torch.signbit(by_value[zero[0]]) and not torch.signbit(by_value[zero[1]])  # -0.0 sorted first by hand
    order[zero] = torch.sort(order[zero]).values
    assert torch.equal(order[1:] - order[:-1], torch.ones(order.numel() - 1, dtype=torch.long))
    assert torch.equal(_from_ordered(ordered(patterns), dtype).view(torch.int16), patterns.view(torch.int16))


def test_a_few_changed_elements_cost_a_few_bytes_and_a_rewritten_bucket_goes_dense():
    old = _state()
    manifest, base = _base(old)
    new = dict(old)
    new["proj.weight"] = old["proj.weight"].clone()
    new["proj.weight"][3, 5] += 1.0
    new["proj.weight"][100, 63] -= 1.0
    new["embed.weight"] = old["embed.weight"] + 1.0  # every element: its buckets are smaller sent dense
    delta, buffers = encode(manifest, named_items(new), base, 7)
    assert delta.base_version == 7 and [b.nbytes for b in delta.buckets] == [b.numel() for b in buffers]
    proj_bucket = next(e.bucket for e in manifest.entries if e.name == "proj.weight")
    embed_buckets = {e.bucket for e in manifest.entries if e.name == "embed.weight"}
    assert delta.buckets[proj_bucket].sparse is not None and delta.buckets[proj_bucket].nbytes <= 32
    assert all(delta.buckets[b].sparse is None for b in embed_buckets)
    assert delta.nbytes < manifest.nbytes - manifest.bucket_sizes[proj_bucket] + 64
    weights = {k: v.clone() for k, v in base.views()}
    apply(decode(manifest, delta, buffers, weights), weights)
    assert all(torch.equal(weights[k], v.to(BF16)) for k, v in new.items())


def test_ten_deltas_equal_a_dense_cast_bit_for_bit_and_send_few_bytes():
    """The learner's base through a chain of small updates (mostly below half a bf16 ulp), with the receiver's
    copy patched by each delta; signed zeros count by their bits."""
    state = _state(1)
    state["proj.weight"][0, :4] = 0.0
    sender, receiver = DeltaSender(), None
    sent, dense = 0, 0
    for version in range(1, 12):
        items = named_items(state)
        manifest = plan(items, 4096, BF16)
        wire = sender.wire(manifest, items)
        if version == 1:
            assert wire.plan is None  # no base yet: dense
            receiver = Buckets(manifest)
            for dst, src in zip(receiver.buffers, wire.buffers):
                dst.copy_(src)
        else:
            assert wire.plan is not None and wire.plan.base_version == version - 1
            held = dict(receiver.views())
            apply(decode(manifest, wire.plan, wire.buffers, held), held)
            sent, dense = sent + wire.nbytes, dense + manifest.nbytes
        sender.commit(wire, version, items)
        want = _as_bf16(state)
        for got in (dict(receiver.views()), dict(sender.base.views())):
            assert all(torch.equal(got[k].view(torch.int16), want[k].view(torch.int16)) for k in want
                       if want[k].numel())
        state = _step(state, 1e-6, version)
        state["proj.weight"][0, version % 4] *= -1  # 0.0 <-> -0.0: equal values, other bits
    assert sent * 10 < dense, (sent, dense)


def _corrupted(manifest, delta: DeltaPlan, buffers, bucket: int, change) -> tuple[DeltaPlan, list]:
    sparse = list(delta.buckets[bucket].sparse)
    buffers = [b.clone() for b in buffers]
    sparse[0] = change(sparse[0], buffers[bucket])
    codes = list(delta.buckets)
    codes[bucket] = dataclasses.replace(codes[bucket], sparse=tuple(sparse))
    return dataclasses.replace(delta, buckets=tuple(codes)), buffers


def _set_value(value: float):
    def change(s, buf):
        buf[s.values_at:s.values_at + 2].view(BF16)[0] = value
        return s
    return change


def _last_code(buf_value: int):
    def change(s, buf):
        buf[s.codes_at + s.codes * s.width - 1] = buf_value
        return s
    return change


def _zero_first_code(s, buf):
    buf[s.codes_at:s.codes_at + s.width] = 0  # an escape where the count says every code is a position
    return s


@pytest.mark.parametrize("change, message", [
    (lambda s, buf: dataclasses.replace(s, count=s.count - 1), "counts 1 changed elements but its position codes "
                                                               "hold 2"),
    (lambda s, buf: dataclasses.replace(s, count=s.count + 1), "counts 3 changed elements of 8192 in 2 position "
                                                               "codes"),
    (_zero_first_code, "counts 2 changed elements but its position codes hold 1"),
    (lambda s, buf: dataclasses.replace(s, codes=s.codes + 1000), "run past the bucket"),
    (_last_code(255), "a position \\(\\d+\\) lies past its 8192 elements"),
    (_set_value(float("nan")), "a value is NaN or inf"),
    (_set_value(float("inf")), "a value is NaN or inf"),
    (_set_value(1e30), "a value is 1e\\+30, beyond the canary's bound 1e\\+06"),
    (lambda s, buf: dataclasses.replace(s, width=3), "codes are 3 bytes wide"),
    (lambda s, buf: dataclasses.replace(s, width=0), "sent whole with 2 of its 8192 elements"),
    (lambda s, buf: dataclasses.replace(s, values_at=s.values_at + 1), "misaligned"),
    (lambda s, buf: dataclasses.replace(s, entry=0), "listed in bucket 1, the manifest puts it in 0"),
    (lambda s, buf: dataclasses.replace(s, entry=-1), "lists a malformed tensor"),
])
def test_a_corrupt_delta_is_refused_naming_the_weight_before_anything_is_written(change, message):
    state = {"a.weight": torch.zeros(64), "b.weight": torch.randn(128, 64) * 0.02}
    manifest, base = _base(state, bucket_bytes=1024)
    new = {"a.weight": state["a.weight"], "b.weight": state["b.weight"].clone()}
    new["b.weight"].view(-1)[[7, 8000]] = 0.5
    delta, buffers = encode(manifest, named_items(new), base, 1)
    assert delta.buckets[1].sparse is not None and delta.buckets[1].sparse[0].width == 2
    bad, bad_buffers = _corrupted(manifest, delta, buffers, 1, change)
    named = "a.weight" if "puts it in 0" in message else "b.weight"
    pattern = message if "malformed" in message else f"the delta for '{named}' is corrupt: .*{message}"
    with pytest.raises(ValueError, match=f"{pattern}.*nothing was changed"):
        decode(manifest, bad, bad_buffers, dict(base.views()))
    assert len(decode(manifest, delta, buffers, dict(base.views()))) == 1  # the intact delta decodes


def test_a_push_with_check_finite_false_carries_its_values_unchecked():
    manifest, base = _base({"w": torch.zeros(64)})
    new = {"w": torch.zeros(64)}
    new["w"][3] = float("nan")
    delta, buffers = encode(manifest, named_items(new), base, 1)
    with pytest.raises(ValueError, match="the delta for 'w' is corrupt: a value is NaN or inf"):
        decode(manifest, delta, buffers, dict(base.views()))
    delta, buffers = encode(manifest, named_items(new), base, 1, checked=False)
    (write,) = decode(manifest, delta, buffers, dict(base.views()))
    assert write.index.tolist() == [3] and write.values.isnan().all()


def test_a_delta_that_does_not_fit_the_manifest_is_refused():
    manifest, base = _base({"a.weight": torch.zeros(64), "b.weight": torch.zeros(128, 64)}, bucket_bytes=1024)
    delta, buffers = encode(manifest, named_items({"a.weight": torch.ones(64), "b.weight": torch.zeros(128, 64)}),
                            base, 1)
    with pytest.raises(ValueError, match="2 bucket codes and 1 buffers for 2 buckets"):
        decode(manifest, delta, buffers[:1], dict(base.views()))
    assert delta.buckets[0].sparse is None and delta.buckets[1].sparse == ()  # all changed / none changed
    with pytest.raises(ValueError, match="bucket 0 holds 64 bytes, its code says 128"):
        decode(manifest, delta, [buffers[0][:64], buffers[1]], dict(base.views()))
    dense_code = dataclasses.replace(delta, buckets=(delta.buckets[0], BucketCode(buffers[1].numel())))
    with pytest.raises(ValueError, match="dense bucket 1 holds 8 bytes, the manifest's 16384"):
        decode(manifest, dense_code, buffers, dict(base.views()))
    with pytest.raises(ValueError, match="must be a DeltaPlan"):
        decode(manifest, {"base_version": 1}, buffers, dict(base.views()))


def test_the_delta_argument_and_when_a_push_may_be_a_delta():
    for ok in ("auto", True, False):
        check_delta(ok)
    for bad in ("yes", 1, 0, None, "True"):
        with pytest.raises(ValueError, match="delta=.*choose one of \\('auto', True, False\\)"):
            check_delta(bad)
    bf16 = [{"weights_dtype": "bfloat16", "quantization": None}] * 2
    assert delta_dtype("auto", "object_store", False, bf16) is BF16
    assert delta_dtype(True, "broadcast", False, bf16) is BF16
    assert delta_dtype(False, "object_store", False, bf16) is None
    assert delta_dtype("auto", "cuda_ipc", False, bf16) is None
    assert delta_dtype("auto", "object_store", True, bf16) is None
    assert delta_dtype("auto", "object_store", False, [{"weights_dtype": None}]) is None  # (no model to say)
    fp8 = [{"weights_dtype": "bfloat16", "quantization": "fp8"}]
    assert delta_dtype("auto", "object_store", False, fp8) is None
    for transport, partial, targets, why in (("cuda_ipc", False, bf16, "CUDA IPC copies no bytes"),
                                             ("object_store", True, bf16, "needs every weight \\(partial=False\\)"),
                                             ("object_store", False, fp8, "quantize every refresh to FP8")):
        with pytest.raises(ValueError, match=f"delta=True.*{why}"):
            delta_dtype(True, transport, partial, targets)
    assert delta_refusal("in_process", False, None) is None


def test_the_in_process_client_takes_delta_and_validates_it_as_over_ray():
    from rollout_service.client import RolloutClient

    model = tiny_hf_model("llama", seed=3)
    with RolloutClient.local(model=model, backend="torch", dtype="bfloat16", device="cpu", num_pages=16,
                             enable_cuda_graphs=False) as client:
        state = model.state_dict()
        before = client.weights_digests()
        with pytest.raises(ValueError, match="delta='maybe'; choose one of"):
            client.update_weights(state, 1, delta="maybe")
        with pytest.raises(ValueError, match="delta=True needs every weight"):
            client.update_weights({"lm_head.weight": state["lm_head.weight"]}, 1, partial=True, delta=True)
        with pytest.raises(ValueError, match="delta=True: CUDA IPC copies no bytes"):
            client.update_weights(state, 1, transport="cuda_ipc", delta=True)
        assert client.weights_digests() == before
        new = _step(dict(state), 1e-3, 0)
        assert client.update_weights(new, 1, delta=True) == "in_process"
        assert client.update_weights(state, 2, delta=False) == "in_process"
        assert client.weights_digests() == before  # back to the first weights, bit for bit


@pytest.mark.parametrize("seed", range(4))
def test_buckets_of_many_tensors_at_every_density_decode_to_the_new_weights(seed):
    """One pass per bucket finds every tensor's changes: sparse ones (gaps past both escape widths), moves far
    enough to go raw, dense rewrites sent whole or as a dense bucket, untouched tensors, signed zeros."""
    old, new = before_and_after(seed)
    manifest, base = _base(old, bucket_bytes=700_000)
    delta, buffers = encode(manifest, named_items(new), base, 3)
    assert any(b.sparse is not None for b in delta.buckets)
    weights = {k: v.clone() for k, v in base.views()}
    apply(decode(manifest, delta, buffers, dict(base.views())), weights)
    for k, v in new.items():
        assert torch.equal(weights[k].view(torch.int16), v.to(BF16).view(torch.int16)), k


def test_auto_times_both_kinds_then_sends_the_faster_and_retries_the_slower_every_few_pushes():
    pace = PushPace()
    assert pace.prefer_delta()  # nothing timed: a delta is tried (the first push is dense anyway: no base)
    pace.note(False, 1.0)
    assert pace.prefer_delta()  # dense timed, delta not yet
    pace.note(True, 3.0)  # slower
    dense = 0
    while not pace.prefer_delta():
        pace.note(False, 1.0)
        dense += 1
    assert dense == PROBE_EVERY  # then the delta once more
    pace.note(True, 0.2)  # faster now, but its figure (an EMA: 1.6) still says slower
    assert not pace.prefer_delta()
    fresh = PushPace()
    fresh.note(False, 1.0)
    fresh.note(True, 0.3)
    kinds = []
    for _ in range(PROBE_EVERY + 2):
        kinds.append(fresh.prefer_delta())
        fresh.note(kinds[-1], 0.3 if kinds[-1] else 1.0)
    assert kinds.count(False) == 1 and kinds[-1]  # one dense push to time it again, deltas around it
