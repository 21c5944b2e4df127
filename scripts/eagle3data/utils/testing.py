"""Test-only hooks: make chosen samples fail, or stop a run at a named point. Never set in real runs.

- `testing.fail_samples: [sample ids]` in the config: extract fails each listed sample when it computes
  it, as if its request had failed, so the per-sample failure path runs on a real engine.
- `EAGLE3DATA_TEST_KILL_AT=<pattern>[#n]` in the environment: the n-th time (default 1) this process
  reaches a point whose name matches the glob `pattern`, it SIGKILLs its whole process group: started
  in its own session, that is the whole `snakemake` run, as a node crash or `kill -9` would. An engine
  server runs in a session of its own: a kill point reached under it kills the group of the job that
  started it too (`with_run_group`), so the kill is still the whole run's.
- `EAGLE3DATA_TEST_KILL_ENGINE_AT=<pattern>` in an extract job's environment: the engine server serving
  it (engine/server.py) SIGKILLs itself and vLLM's processes under it, and nothing else, the first time
  it reaches a point of that job matching `pattern`: an engine crash, which must fail only the job it
  serves. The job sends the setting with its requests (a server outlives the run that started it).
- `EAGLE3DATA_TEST_ORPHAN_KEEP_ALIVE_S=<seconds>` in a run's environment: how long its engine server,
  once the run is gone, waits idle for a re-run before it stops (engine/server.py; 60 s otherwise).
- `EAGLE3DATA_TEST_PAUSE_AT=<pattern>[#n]`: at that point the process says so on stderr and waits until
  it is killed, so that a test can cancel a job (`scancel`) at a known point, not at whatever point a
  race with the job's own progress gives.

Points: `extract:engine_ready` (before the first sample), `extract:batch_done` (after each batch's
generate() returned and its replies were checked; its files are checked as they land),
`engine:generate:<shard>` (in the engine server, before each batch's generate() for that shard's job), `regenerate:stored` (after each response is journaled and fsynced), `write:<final path>` (a file written in full under its temporary name, not yet renamed: `store.atomic_path`, in
whichever process writes it, vLLM's worker included).
"""

from __future__ import annotations

import collections
import fnmatch
import os
import signal
import sys
import time

KILL_ENV = "EAGLE3DATA_TEST_KILL_AT"
KILL_GROUP_ENV = "EAGLE3DATA_TEST_KILL_GROUP"  # the run's process group, for processes outside it
KILL_ENGINE_ENV = "EAGLE3DATA_TEST_KILL_ENGINE_AT"
PAUSE_ENV = "EAGLE3DATA_TEST_PAUSE_AT"
PAUSED = "pausing until killed"  # in the line a paused process writes
_reached: collections.Counter = collections.Counter()


class FailedOnPurpose(RuntimeError):
    """The failure `testing.fail_samples` asks for."""


def fail_on_purpose(sample_id: str, fail_samples) -> None:
    if sample_id in fail_samples:
        raise FailedOnPurpose(
            f"sample {sample_id}: failed on purpose: expected no sample in testing.fail_samples (a "
            f"test-only hook), found it listed there"
        )


def _reached_nth(env: str, name: str) -> str | None:
    """The hook's setting when this is the n-th time this process reaches a point it names, else None."""
    spec = os.environ.get(env)
    if not spec:
        return None
    pattern, _, nth = spec.partition("#")
    if not fnmatch.fnmatchcase(name, pattern):
        return None
    _reached[env, pattern] += 1
    return spec if _reached[env, pattern] == int(nth or 1) else None


def with_run_group(env: dict) -> dict:
    """`env` for a process started in a session of its own: a kill hook there kills this run too."""
    if KILL_ENV in env and KILL_GROUP_ENV not in env:
        return {**env, KILL_GROUP_ENV: str(os.getpgrp())}
    return env


def kill_point(name: str) -> None:
    """SIGKILL this process group (and the run's), or wait to be killed, if the hooks name this point."""
    if spec := _reached_nth(KILL_ENV, name):
        own = os.getpgrp()
        run = int(os.environ.get(KILL_GROUP_ENV, own))
        print(f"{KILL_ENV}={spec}: killing process groups {sorted({run, own})} at {name}", file=sys.stderr,
              flush=True)
        if run != own:
            os.killpg(run, signal.SIGKILL)
        os.killpg(own, signal.SIGKILL)  # last: this process is in it
    if spec := _reached_nth(PAUSE_ENV, name):
        print(f"{PAUSE_ENV}={spec}: {PAUSED} at {name}", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)


def kill_engine_point(name: str, spec: str | None) -> None:
    """SIGKILL this process and its descendants (an engine server and vLLM's processes) the first time
    it reaches a point matching `spec`, the KILL_ENGINE_ENV setting of the job it serves."""
    if not spec or not fnmatch.fnmatchcase(name, spec) or _reached[KILL_ENGINE_ENV, spec]:
        return
    _reached[KILL_ENGINE_ENV, spec] += 1
    import psutil

    print(f"{KILL_ENGINE_ENV}={spec}: killing engine process {os.getpid()} at {name}", file=sys.stderr,
          flush=True)
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os.kill(os.getpid(), signal.SIGKILL)
