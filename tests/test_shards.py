"""The shard plan (eagle3data.plan.shards): every input row in exactly one shard, in order, in shards of
shard_size but the last."""

from __future__ import annotations

import pytest

from eagle3data.plan.shards import plan


@pytest.mark.parametrize("conversations", [0, 1, 2, 7, 8, 9, 20, 6144])
def test_the_shards_cover_the_input_in_order(conversations):
    shard_size = 8 if conversations < 100 else 768
    rows = plan(conversations, shard_size)
    assert rows[0][0] == 0 and rows[-1][1] == conversations
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous: no row lost or repeated
    assert all(stop - start == shard_size for start, stop in rows[:-1])
    assert 0 < rows[-1][1] - rows[-1][0] <= shard_size or conversations == 0


def test_the_last_shard_holds_the_rest():
    assert plan(20, 8) == [(0, 8), (8, 16), (16, 20)]
    assert plan(0, 8) == [(0, 0)]


def test_a_plan_refuses_sizes_that_cannot_hold_rows():
    with pytest.raises(ValueError, match="shard_size >= 1"):
        plan(10, 0)
