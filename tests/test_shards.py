"""The shard plan (eagle3data.shards): every input row in exactly one shard, in order; shard_taper splits
only the last shard, into halving pieces."""

from __future__ import annotations

import pytest

from eagle3data.shards import plan


@pytest.mark.parametrize("conversations", [0, 1, 2, 7, 8, 9, 20, 6144])
@pytest.mark.parametrize("taper", [0, 1, 3, 10])
def test_the_shards_cover_the_input_in_order_and_only_the_last_is_split(conversations, taper):
    shard_size = 8 if conversations < 100 else 768
    rows = plan(conversations, shard_size, taper)
    assert rows[0][0] == 0 and rows[-1][1] == conversations
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))  # contiguous: no row lost or repeated
    untapered = plan(conversations, shard_size)
    assert rows[: len(untapered) - 1] == untapered[:-1]  # the shards before the last are untouched
    pieces = [stop - start for start, stop in rows[len(untapered) - 1 :]]
    assert all(size > 0 for size in pieces) or conversations == 0
    assert len(pieces) <= taper + 1
    assert all(a >= b for a, b in zip(pieces, pieces[1:]))  # halving, the last two equal or one apart


def test_a_taper_of_three_on_a_shard_of_768():
    assert plan(6144, 768, 3)[-4:] == [(5376, 5760), (5760, 5952), (5952, 6048), (6048, 6144)]
    assert plan(20, 8, 0) == [(0, 8), (8, 16), (16, 20)]


def test_a_plan_refuses_sizes_that_cannot_hold_rows():
    with pytest.raises(ValueError, match="shard_size >= 1"):
        plan(10, 0)
