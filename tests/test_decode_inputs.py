"""DecodeInputs (one flat buffer per decode step) describes the same step as make_metadata."""
import random

import pytest
import torch

from rollout_service.engine.decode_inputs import DecodeInputs
from rollout_service.ops.attention import make_metadata

PS = 16


def random_step(rng: random.Random, batch: int, max_pages: int):
    lengths = [rng.randint(1, max_pages * PS) for _ in range(batch)]
    free = rng.sample(range(1, 10_000), sum(-(-n // PS) for n in lengths))
    tables, at = [], 0
    for n in lengths:
        k = -(-n // PS)
        tables.append(free[at:at + k])
        at += k
    return tables, [rng.randint(0, 999) for _ in lengths], lengths


def test_matches_make_metadata_over_refills():
    rng = random.Random(0)
    inputs = DecodeInputs(max_batch=12, max_pages=9, page_size=PS, device="cpu")
    for batch in (12, 1, 7, 3, 12, 5):  # shrinking and growing refills must not leave stale entries behind
        tables, tokens, lengths = random_step(rng, batch, 9)
        ref = make_metadata(tables, [1] * batch, lengths, PS, is_prefill=False)
        inputs.fill(tables, tokens, lengths, rows=batch)
        inputs.upload()
        ids, meta = inputs.batch(batch)
        assert ids.tolist() == tokens
        for name in ("slot_mapping", "positions", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                     "kv_lens", "block_tables"):
            assert getattr(meta, name).tolist() == getattr(ref, name).tolist(), name
        assert not meta.is_prefill and meta.max_q_len == 1 and meta.max_kv_len == 9 * PS
        _, full = inputs.batch(batch, full_tables=True)
        assert full.block_tables.shape == (batch, 9)
        assert full.block_tables[:, ref.block_tables.shape[1]:].eq(0).all()  # beyond a table: scratch page


def test_padding_rows_are_one_token_sequences_on_the_scratch_page():
    inputs = DecodeInputs(max_batch=8, max_pages=4, page_size=PS, device="cpu")
    inputs.fill([[5, 6], [9]], [11, 12], [20, 3], rows=5)
    ids, meta = inputs.batch(5)
    assert inputs.rows == 5 and ids.tolist() == [11, 12, 0, 0, 0]
    assert meta.kv_indptr.tolist() == [0, 2, 3, 4, 5, 6]
    assert meta.kv_indices.tolist() == [5, 6, 9, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [6 * PS + 3, 9 * PS + 2, 0, 0, 0]
    assert meta.kv_lens.tolist() == [20, 3, 1, 1, 1] and meta.kv_last_page_len.tolist() == [4, 3, 1, 1, 1]


def test_longer_page_lists_are_cut_to_the_length():
    inputs = DecodeInputs(max_batch=2, max_pages=4, page_size=PS, device="cpu")
    inputs.fill([[5, 6, 7]], [1], [17], rows=1)  # a third page allocated ahead is not part of the step
    assert inputs.batch(1)[1].kv_indices.tolist() == [5, 6]


@pytest.mark.parametrize("bad", [
    dict(tables=[[1]] * 3, tokens=[0] * 3, lengths=[1] * 3, rows=3),   # more rows than the buffer holds
    dict(tables=[[1]], tokens=[0], lengths=[1], rows=0),               # fewer rows than sequences
    dict(tables=[list(range(1, 6))], tokens=[0], lengths=[5 * PS], rows=1),  # more pages than max_pages
])
def test_bad_fills_name_the_problem(bad):
    inputs = DecodeInputs(max_batch=2, max_pages=4, page_size=PS, device="cpu")
    with pytest.raises(ValueError, match="rows|pages"):
        inputs.fill(bad["tables"], bad["tokens"], bad["lengths"], bad["rows"])


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="max_batch"):
        DecodeInputs(0, 4, PS, "cpu")
