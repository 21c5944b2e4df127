"""The shard plan: which input rows each shard holds (the rules' `shard_rows`, the extract job's
free-space estimate).

Shards are contiguous input ranges of `shard_size` conversations, so appending rows adds shards and
leaves the finished ones alone. What follows the last extract job is that shard's validate and pack
(its bytes written once more, at the disk's pace) and the index: with `shard_taper` the last shard's
rows are split into shards of halving size (1/2, 1/4, ..., the rest in two), so the run's tail is
that fraction of a shard while the larger pieces are packed beside the last extraction. It costs a few
more jobs, and an append re-plans those few shards (their states are reused, not computed again).
"""

from __future__ import annotations


def plan(conversations: int, shard_size: int, taper: int = 0) -> list[tuple[int, int]]:
    """Input rows `[start, stop)` of each shard, in input order (one empty shard for an empty input)."""
    if shard_size < 1 or taper < 0:
        raise ValueError(f"shard plan: shard_size >= 1 and shard_taper >= 0 expected, found {shard_size}, {taper}")
    ranges = [(start, min(start + shard_size, conversations)) for start in range(0, conversations, shard_size)]
    start, stop = ranges.pop() if ranges else (0, 0)
    for _ in range(taper):
        half = (stop - start + 1) // 2
        if half >= stop - start:  # one row left: nothing to split
            break
        ranges.append((start, start + half))
        start += half
    ranges.append((start, stop))
    return ranges


def conversations_of(rows: tuple[tuple[int, int], ...], shards: list[int]) -> int:
    """Conversations of the shards numbered `shards` in the plan `rows`."""
    return sum(rows[i][1] - rows[i][0] for i in shards if 0 <= i < len(rows))
