"""Finding, claiming and starting the node's capturing engines (engine/server.py), from an extract job.

An extract job asks for an engine with its exact settings (the `vllm.LLM` arguments: model, dtype,
captures, store, batching...), hashed into a key. The node's servers are listed in a registry directory
scoped to the node and the SLURM allocation (`jobinfo.node_scope`): one entry file per ready server and
a lock file (`<id>.busy`) that a job holds for as long as it uses that server, so each server serves one
job at a time. A job takes a free server of its key; if there is none, it starts one (claiming its GPUs
first, stopping idle servers of other settings that hold them) and holds it; when the GPUs are held by
servers in use, it waits for one of them (or for the GPUs) to be free. Data-parallel jobs (several
TP-1 engines on one node) thus each get a server of their own, and a job that follows reuses a server
whose previous job has finished. A server whose process died is found by its failed connection and
removed from the registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client
from pathlib import Path
from typing import BinaryIO

from eagle3data.engine import jobinfo
from eagle3data.engine.jobinfo import try_lock
from eagle3data.engine.start import EngineError, check_schedulable
from eagle3data.utils.logs import get_logger
from eagle3data.storage.store import atomic_write_text
from eagle3data.utils.testing import KILL_ENGINE_ENV

logger = get_logger(__name__)

LOG_REPLY_BYTES = 1 << 20  # at most this much of a server's log comes back with one request
POLL_S = 0.2  # how often a starting job looks for its server's entry
HANDOFF_POLL_S = 0.02  # how often a queued job looks for its engine to come free
STOP_WAIT_S = 120.0  # how long a stopped server may take to exit before it is killed


class EngineCrashed(EngineError):
    """The server died while it was serving this job: the job's samples in flight are lost."""


@dataclass
class ServerEntry:
    """A server as the registry lists it (its `<id>.json`, written when the engine is ready)."""

    id: str
    key: str
    node: str
    socket: str
    authkey: str
    log: str
    path: str  # this entry's file
    busy: str  # the lock a job holds while it uses the server
    run_dir: str
    started_by: str
    pid: int = 0
    start_seconds: float | None = None
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool | None = None


def registry() -> Path:
    path = jobinfo.ENGINE_ROOT / jobinfo.node_scope()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def engine_key(kwargs: dict, cpu_kv_cache_gib: int) -> str:
    """What makes two engines interchangeable: every `vllm.LLM` argument and the CPU KV cache size."""
    text = json.dumps({"kwargs": kwargs, "cpu_kv_cache_gib": cpu_kv_cache_gib}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entries() -> list[ServerEntry]:
    found = []
    for path in sorted(registry().glob("*.json")):
        try:
            found.append(ServerEntry(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # being written or removed right now
    return found


class RemoteEngine:
    """A server held by this job: `generate` runs one batch, `close` hands the server back."""

    def __init__(self, entry: ServerEntry, busy: BinaryIO, conn, loaded_here: bool):
        self.entry, self._busy, self._conn, self.loaded_here = entry, busy, conn, loaded_here

    def begin_shard(self, shard: str) -> int:
        """Tell the server which shard it serves now (its log says so), with this job's test-only
        engine-kill hook (utils/testing.py); the server's count of shards served."""
        return self._request(("shard", shard, os.environ.get(KILL_ENGINE_ENV)), 0)[1]

    def generate(self, token_ids: list[list[int]], paths: list[str]) -> list:
        """kv_transfer_params of each prompt; what the engine logged meanwhile goes to this job's log."""
        reply = self._request(("generate", token_ids, paths), len(paths))
        if reply[0] != "ok":
            raise EngineError(f"engine {self.entry.id} failed a batch of {len(paths)} samples:\n{reply[1]}")
        sys.stderr.write(reply[2])
        return reply[1]

    def check_prompt_fits(self, longest_prompt: int) -> None:
        """Refuse work the engine's scheduler would never schedule (engine.check_schedulable)."""
        check_schedulable(bool(self.entry.chunked_prefill), self.entry.max_num_batched_tokens, longest_prompt)

    def _request(self, message: tuple, samples: int) -> tuple:
        try:
            self._conn.send(message)
            return self._conn.recv()
        except (EOFError, ConnectionError, BrokenPipeError) as exc:
            Path(self.entry.path).unlink(missing_ok=True)
            raise EngineCrashed(
                f"engine {self.entry.id} (pid {self.entry.pid} on {self.entry.node}) went away while "
                f"serving this job ({type(exc).__name__}, {samples} samples in flight): this shard fails, "
                f"the other shards start or find another engine, and a re-run computes what is missing. "
                f"The end of its log ({self.entry.log}):\n{log_tail(self.entry.log)}"
            ) from exc

    def close(self) -> None:
        self._conn.close()
        self._busy.close()


def acquire(kwargs: dict, cpu_kv_cache_gib: int, captures: list[dict], keep_alive_s: float,
            gpus: int, run_dir: str, started_by: str) -> RemoteEngine:
    """A server with exactly these settings, held by this job: a free one of the node, else a new one on
    GPUs claimed for it. While neither can be had (busy servers hold the GPUs, or a server of these
    settings is still starting on them) the job waits and looks again: jobs started side by side beyond
    the node's GPUs (Snakemake without `--resources gpu=N`) queue for its engines instead of starting
    engines on GPUs in use."""
    key = engine_key(kwargs, cpu_kv_cache_gib)
    spec = {"kwargs": kwargs, "cpu_kv_cache_gib": cpu_kv_cache_gib, "captures": captures,
            "keep_alive_s": keep_alive_s}
    among = jobinfo.gpus_to_claim(gpus)
    waiting = False
    while (engine := take_free(key)) is None:
        if gpus:
            stop_idle(lambda e: e.key != key)  # idle servers of other settings may hold the GPUs needed
        claimed = None if among is None else jobinfo.try_claim_gpus(gpus, among, jobinfo.gpu_lock_scope())
        if among is None or claimed is not None:
            return start_server(key, spec, claimed, run_dir, started_by)
        if not waiting:
            logger.info("waiting for a free engine of these settings or %d free GPUs of %s (engines in use "
                        "hold them)", gpus, among)
            waiting = True
        engine = _wait_for_free(key, jobinfo.POLL_S)
        if engine is not None:
            break
    return engine


def _wait_for_free(key: str, seconds: float) -> RemoteEngine | None:
    """Look for a free server of this key every HANDOFF_POLL_S for `seconds`: a queued job takes the
    engine within that of its release (the GPUs stay idle meanwhile); None if none came free."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(HANDOFF_POLL_S)
        if (engine := take_free(key)) is not None:
            return engine
    return None


def take_free(key: str) -> RemoteEngine | None:
    """A ready server of this key that no job holds, now held by this job; None if there is none."""
    for entry in entries():
        if entry.key != key or (busy := try_lock(Path(entry.busy))) is None:
            continue
        conn = connect(entry)
        if conn is None:  # it died (or stopped) since it wrote its entry
            Path(entry.path).unlink(missing_ok=True)
            busy.close()
            continue
        logger.info("engine %s on %s (loaded in %.1f s by %s) is free: this job uses it; its log: %s",
                    entry.id, entry.node, entry.start_seconds, entry.started_by, entry.log)
        return RemoteEngine(entry, busy, conn, loaded_here=False)
    return None


def start_server(key: str, spec: dict, claimed: dict[str, BinaryIO] | None, run_dir: str,
                 started_by: str) -> RemoteEngine:
    """Start a server on the GPUs claimed for it (None: those visible), which it holds from then on, and
    wait until it is ready."""
    server_id = f"{key[:8]}-{secrets.token_hex(4)}"
    scope = registry()
    log_dir = Path(run_dir) / "logs" / "engine"
    log_dir.mkdir(parents=True, exist_ok=True)
    entry = ServerEntry(
        id=server_id, key=key, node=socket.gethostname(), socket=str(scope / f"{server_id}.sock"),
        authkey=secrets.token_hex(16), log=str((log_dir / f"{jobinfo.node_scope()}-{server_id}.log").resolve()),
        path=str(scope / f"{server_id}.json"), busy=str(scope / f"{server_id}.busy"),
        run_dir=str(Path(run_dir).resolve()), started_by=started_by,
    )
    busy = try_lock(Path(entry.busy))  # a new file: nobody else can hold it
    spec_path = scope / f"{server_id}.spec.json"
    atomic_write_text(spec_path, json.dumps({**spec, "entry": asdict(entry)}))
    env = dict(os.environ)
    if claimed is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(claimed)
    logger.info("starting engine %s on %s (GPUs %s); its log: %s", server_id, entry.node,
                env.get("CUDA_VISIBLE_DEVICES", "none"), entry.log)
    with open(entry.log, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "eagle3data.engine.server", str(spec_path)], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, env=env,
            pass_fds=[lock.fileno() for lock in (claimed or {}).values()],
        )
    for lock in (claimed or {}).values():
        lock.close()  # the server holds the GPUs now
    while not Path(entry.path).exists():
        if process.poll() is not None:
            busy.close()
            raise EngineError(f"engine {server_id} exited with code {process.returncode} while starting; "
                              f"the end of its log ({entry.log}):\n{log_tail(entry.log)}")
        time.sleep(POLL_S)
    entry = ServerEntry(**json.loads(Path(entry.path).read_text()))
    sys.stderr.write(Path(entry.log).read_text(errors="replace"))  # the engine's start, in this job's log
    conn = connect(entry)
    if conn is None:
        busy.close()
        raise EngineError(f"engine {server_id} is ready but refuses connections; its log: {entry.log}")
    return RemoteEngine(entry, busy, conn, loaded_here=True)


def connect(entry: ServerEntry):
    try:
        return Client(entry.socket, family="AF_UNIX", authkey=bytes.fromhex(entry.authkey))
    except (OSError, EOFError):
        return None


def stop_idle(which=lambda entry: True) -> int:
    """Stop this node's idle servers that `which` selects, waiting until each has exited; how many."""
    stopped = 0
    for entry in entries():
        if not which(entry) or (busy := try_lock(Path(entry.busy))) is None:
            continue
        with busy:
            conn = connect(entry)
            Path(entry.path).unlink(missing_ok=True)
            if conn is None:
                continue
            with conn:
                try:
                    conn.send(("stop",))
                    conn.recv()
                except (EOFError, ConnectionError):
                    pass
            wait_exited(entry.pid)
            logger.info("stopped idle engine %s on %s", entry.id, entry.node)
            stopped += 1
    return stopped


def stop_idle_of_run(run_dir: str) -> int:
    """At the end of a successful run: its engines have nothing left to do."""
    run = str(Path(run_dir).resolve())
    return stop_idle(lambda entry: entry.run_dir == run)


def wait_exited(pid: int) -> None:
    import psutil

    try:
        process = psutil.Process(pid)
        process.wait(STOP_WAIT_S)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        logger.warning("engine process %d did not exit within %.0f s of being stopped: killing it", pid,
                       STOP_WAIT_S)
        for child in process.children(recursive=True):
            child.kill()
        process.kill()


def log_tail(path: str, chars: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(unreadable: {exc})"
