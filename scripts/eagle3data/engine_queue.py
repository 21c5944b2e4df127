"""The order in which queued extract jobs take a node's engine: the most tokens to compute first.

Extract jobs side by side beyond an engine's GPUs queue for it (engine_pool.acquire). Their order
decides a run's tail: after the last extract job come that shard's validate and pack (its bytes written
at the disk's pace) and the index, so the last shard extracted should be the smallest (`shard_taper`
makes small ones). Snakemake starts the larger shards first among those ready (rule extract's
priority), but the small shards, tokenized first, are ready first. So a queued job enters its tokens here, and a free engine goes to the queued job with the most
(of equal ones, the one queued first); the job that loaded the engine hands it on to such a job too.

A place in the queue is a file `<engine key>.<tokens>.<ns queued>.<pid>.queued` in the node's engine
registry: nothing to lock, and a place whose process is gone (a killed job) is ignored and removed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".queued"


@dataclass(frozen=True)
class Place:
    path: Path
    tokens: int
    since_ns: int

    def ahead_of(self, other: Place) -> bool:
        return (self.tokens, -self.since_ns) > (other.tokens, -other.since_ns)


def join(registry: Path, key: str, tokens: int) -> Place:
    """This job's place in the queue for the engines of `key`."""
    since = time.time_ns()
    place = Place(registry / f"{key}.{tokens}.{since}.{os.getpid()}{SUFFIX}", tokens, since)
    place.path.touch()
    return place


def leave(place: Place) -> None:
    place.path.unlink(missing_ok=True)


def first(registry: Path, key: str, place: Place) -> bool:
    """Whether no other live job queued for `key` comes before this place."""
    return not any(other.ahead_of(place) for other in _places(registry, key) if other.path != place.path)


def anyone_with_more(registry: Path, key: str, tokens: int) -> bool:
    """Whether a live job queued for `key` has more than `tokens` to compute (the loading job's question)."""
    return any(other.tokens > tokens for other in _places(registry, key))


def _places(registry: Path, key: str) -> list[Place]:
    """The live places queued for `key`; those of processes gone are removed on the way."""
    places = []
    for path in registry.glob(f"{key}.*{SUFFIX}"):
        try:
            tokens, since, pid = (int(part) for part in path.name.removesuffix(SUFFIX).split(".")[1:])
        except ValueError:
            continue
        if _alive(pid):
            places.append(Place(path, tokens, since))
        else:
            path.unlink(missing_ok=True)
    return places


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
