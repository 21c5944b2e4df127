"""The one seam through which tests inject faults: a crash, a pause or a failed sample at a named point.

The pipeline's promises about crashes (a killed run loses nothing finished, a failed sample fails alone,
an engine crash fails only its job) are tested on real runs, so the code must be able to crash or fail
on purpose at chosen points. Production code names those points (`point(name)`); only the test
environment turns one into a fault, through the environment variable EAGLE3DATA_FAULTS, read here and
nowhere else: never through the user's config nor a message between processes. Unset, as in every real
run, a point costs one environment lookup.

EAGLE3DATA_FAULTS holds faults separated by ";", each `<action>@<glob>[#n]`: the n-th time (default 1)
this process reaches a point whose name matches the glob, it
- `kill`s its process group with SIGKILL: started in a session of its own, that is the whole
  `snakemake` run, as a node crash or `kill -9` would. A process started in a session of its own (the
  engine server) gets the run's group through `with_run_group`: a kill reached under it is the run's too.
- `kill-engine`s: SIGKILLs itself and its descendants, nothing else. In the engine server: an engine
  crash, which must fail only the job it serves.
- `pause`s: says so on stderr (PAUSED) and waits until it is killed, so that a test cancels a job
  (`scancel`) at a known point, not at whatever point a race with the job's progress gives.
- `fail`s: raises `Injected`, which the caller turns into the failure the point stands for.

Points:
- `extract:batch_done`: the extract job, after each batch's generate() returned and its replies were
  checked (its files are checked as they land).
- `landed:<sample id>`: the extract job's watcher, as it checks a sample's file; `fail` fails the sample
  as if its file were wrong.
- `engine:generate:<shard>`: the engine server, before each batch of that shard's job.
- `regenerate:stored`: the regenerate job, after each response is journaled and fsynced.
- `write:<final path>`: a file written in full under its temporary name, not yet renamed
  (`storage.store.atomic_path`), in whichever process writes it, vLLM's worker included.
- `dropped:<packed shard>`: the pack job, after it dropped the states files the packed shard holds.

An engine server outlives the run that started it, and its faults are that run's environment: when
another run takes it over, it `forget`s them (the other run's environment never reaches it).
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import os
import signal
import sys
import time
from typing import NamedTuple

ENV = "EAGLE3DATA_FAULTS"
_RUN_GROUP_ENV = "EAGLE3DATA_FAULTS_RUN_GROUP"  # the run's process group, for processes outside it
PAUSED = "pausing until killed"  # in the line a paused process writes
_reached: collections.Counter = collections.Counter()


class Injected(RuntimeError):
    """The failure a `fail` fault asks for."""


class Fault(NamedTuple):
    """One `<action>@<pattern>#<nth>` item; it also keys the count of matching points reached."""

    action: str
    pattern: str
    nth: int


@functools.lru_cache(maxsize=4)
def _parse(spec: str) -> tuple[Fault, ...]:
    """The faults of an EAGLE3DATA_FAULTS value; a malformed one is refused, not ignored."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        action, at, rest = item.partition("@")
        pattern, _, nth = rest.partition("#")
        if not at or action not in ACTIONS or not pattern or not (nth or "1").isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected faults '<action>@<glob>[#n]' separated by ';', "
                             f"action one of {', '.join(ACTIONS)}; found {item!r}")
        faults.append(Fault(action, pattern, int(nth or 1)))
    return tuple(faults)


def point(name: str) -> None:
    """This process reached the point `name`: act on each fault of the environment that it triggers."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for fault in _parse(spec):
        if fnmatch.fnmatchcase(name, fault.pattern):
            _reached[fault] += 1
            if _reached[fault] == fault.nth:
                ACTIONS[fault.action](name, f"{ENV}={fault.action}@{fault.pattern}#{fault.nth}")


def _fail(name: str, said: str) -> None:
    raise Injected(f"failed on purpose at {name} ({said}, a test-only fault)")


def _pause(name: str, said: str) -> None:
    print(f"{said}: {PAUSED} at {name}", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def _kill_engine(name: str, said: str) -> None:
    import psutil

    print(f"{said}: killing engine process {os.getpid()} at {name}", file=sys.stderr, flush=True)
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_run(name: str, said: str) -> None:
    own = os.getpgrp()
    run = int(os.environ.get(_RUN_GROUP_ENV, own))
    print(f"{said}: killing process groups {sorted({run, own})} at {name}", file=sys.stderr, flush=True)
    if run != own:
        os.killpg(run, signal.SIGKILL)
    os.killpg(own, signal.SIGKILL)  # last: this process is in it


ACTIONS = {"kill": _kill_run, "kill-engine": _kill_engine, "pause": _pause, "fail": _fail}


def with_run_group(env: dict) -> dict:
    """`env` for a process started in a session of its own: a `kill` reached there kills this run too."""
    if env.get(ENV) and _RUN_GROUP_ENV not in env:
        return {**env, _RUN_GROUP_ENV: str(os.getpgrp())}
    return env


def forget() -> None:
    """No fault from now on in this process: an engine server taken over by another run serves that
    run, whose environment it does not have."""
    os.environ.pop(ENV, None)
    os.environ.pop(_RUN_GROUP_ENV, None)
