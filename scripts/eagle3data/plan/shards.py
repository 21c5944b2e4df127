"""The shard plan: which input rows each shard holds (the rules' `shard_rows`, the extract job's
free-space estimate).

Shards are contiguous input ranges of `shard_size` conversations, so appending rows adds shards and
leaves the finished ones alone.
"""

from __future__ import annotations


def plan(conversations: int, shard_size: int) -> list[tuple[int, int]]:
    """Input rows `[start, stop)` of each shard, in input order (one empty shard for an empty input)."""
    if shard_size < 1:
        raise ValueError(f"shard plan: shard_size >= 1 expected, found {shard_size}")
    ranges = [(start, min(start + shard_size, conversations)) for start in range(0, conversations, shard_size)]
    return ranges or [(0, 0)]


def conversations_of(rows: tuple[tuple[int, int], ...], shards: list[int]) -> int:
    """Conversations of the shards numbered `shards` in the plan `rows`."""
    return sum(rows[i][1] - rows[i][0] for i in shards if 0 <= i < len(rows))


def spread(items: list, count: int) -> list:
    """`count` of `items` evenly spread over them, first and last included (all of them if fewer): the
    samples of a shard the parity gate checks, from different batches of its extract job."""
    if count >= len(items):
        return list(items)
    if count == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]
