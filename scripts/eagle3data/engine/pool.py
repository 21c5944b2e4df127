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

What a job may stop (it never disturbs work it does not own):
- A job holds its server through two locks: `<id>.busy` (exclusive) while it sends requests, and
  `<id>.draining` (shared) until the states files of its last batch have landed, which trails the last
  reply. The next job of the same settings may take the server as soon as `busy` is free; nothing may
  stop it while anyone holds `draining`: an engine is busy until its last reply and its last file are out.
- Only idle servers are stopped (both locks taken by the stopper, so nothing is in flight), and only
  those of this run (`stop_idle_of_run`, at a run's end) or those holding GPUs this job needs and cannot
  otherwise get (`claim_gpus`): never another run's idle engine on other GPUs, and on a CPU node (no
  GPUs) never another run's engine at all.
- A stopped server is asked to stop and waited for; one that does not exit is reported, never SIGKILLed.
- The registry and GPU locks live in this user's private directory (jobinfo.user_dir), per node and
  SLURM allocation; servers are keyed by their exact settings, which include the run's store directory.
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
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Client
from pathlib import Path
from typing import BinaryIO, NamedTuple

from eagle3data.engine import jobinfo
from eagle3data.engine.jobinfo import try_lock
from eagle3data.engine.start import EngineError, check_schedulable
from eagle3data.utils.logs import get_logger
from eagle3data.storage.store import atomic_write_text
from eagle3data.utils.faults import with_run_group

logger = get_logger(__name__)

LOG_REPLY_BYTES = 1 << 20  # at most this much of a server's log comes back with one request
POLL_S = 0.2  # how often a starting job looks for its server's entry
HANDOFF_POLL_S = 0.02  # how often a queued job looks for its engine to come free
STOP_WAIT_S = 120.0  # how long a stopped server may take to exit before the stopper reports it


class EngineCrashed(EngineError):
    """The server died while it was serving this job: the job's samples in flight are lost."""


# The requests a job sends its server (server.py answers each with a tuple, "ok" or "error" first).
class Serve(NamedTuple):
    """From now on the server serves this shard's job, for this run (`run_owner`), which owns it."""

    shard: str
    owner: list


class Generate(NamedTuple):
    """One batch: each prompt's token ids, where its states go, whether its log-probabilities come back."""

    token_ids: list[list[int]]
    paths: list[str]
    log_probs: list[bool]


class Stop(NamedTuple):
    """Stop once idle (`stop_idle` asks only servers that are)."""


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
    draining: str = ""  # shared-locked by each job whose last files may still be landing
    gpus: list[str] = field(default_factory=list)  # the GPUs it holds (claimed for it), if any
    owner: list = field(default_factory=list)  # [pid, start time] of the run that started it (run_owner)


def registry() -> Path:
    return jobinfo.user_dir(jobinfo.ENGINE_ROOT / jobinfo.node_scope())


def run_owner() -> list:
    """[pid, start time] of the process whose life is this run's: the outermost Snakemake process among
    this process's ancestors (the run that scheduled this job; under SLURM's executor, the job's own
    step), else this process itself (a tool or test that drives engines without Snakemake)."""
    import psutil

    owner = psutil.Process()
    for parent in owner.parents():
        try:
            if any("snakemake" in Path(arg).name for arg in parent.cmdline()[:3]):
                owner = parent
        except psutil.Error:
            continue
    return [owner.pid, owner.create_time()]


def owner_alive(owner: list) -> bool:
    """Whether the process `run_owner` named still runs (its pid not reused by another process)."""
    import psutil

    if not owner:
        return True
    try:
        process = psutil.Process(owner[0])
        return abs(process.create_time() - owner[1]) < 0.01 and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
    """A server held by this job: `generate` runs one batch; `hand_back` lets the next job of these
    settings take it while this job's last files land; `close` releases it altogether."""

    def __init__(self, entry: ServerEntry, busy: BinaryIO, draining: BinaryIO | None, conn, loaded_here: bool):
        self.entry, self._busy, self._draining = entry, busy, draining
        self._conn, self.loaded_here = conn, loaded_here

    def begin_shard(self, shard: str) -> int:
        """Tell the server which shard it serves now (its log says so) and this job's run, which the
        server belongs to from now on (server.py: it stops soon after its run is gone); the server's
        count of shards served."""
        return self._request(Serve(shard, run_owner()), 0)[1]

    def generate(self, token_ids: list[list[int]], paths: list[str],
                 log_probs: list[bool] | None = None) -> tuple[list, list]:
        """(kv_transfer_params of each prompt, the engine's next-token log-probabilities of the prompts
        `log_probs` flags, else None); what the engine logged meanwhile goes to this job's log."""
        wanted = log_probs or [False] * len(paths)
        reply = self._request(Generate(token_ids, paths, wanted), len(paths))
        if reply[0] != "ok":
            raise EngineError(f"engine {self.entry.id} failed a batch of {len(paths)} samples:\n{reply[1]}")
        sys.stderr.write(reply[2])
        return reply[1], reply[3]

    def check_prompt_fits(self, longest_prompt: int) -> None:
        """Refuse work the engine's scheduler would never schedule (engine.check_schedulable)."""
        check_schedulable(bool(self.entry.chunked_prefill), self.entry.max_num_batched_tokens, longest_prompt)

    def _request(self, message: Serve | Generate, samples: int) -> tuple:
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

    def hand_back(self) -> None:
        """The last reply is in: the next job of these settings may send its requests; the server is
        still not idle (nobody may stop it) until `close`, once this job's files have landed."""
        self._conn.close()
        self._busy.close()

    def close(self) -> None:
        self.hand_back()
        if self._draining is not None:
            self._draining.close()


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
        claimed = None if among is None else try_claim_gpus(gpus, among, key)
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


def try_claim_gpus(gpus: int, among: list[str], key: str | None = None) -> dict[str, BinaryIO] | None:
    """Lock `gpus` of `among` now; if they are not free, stop the idle servers (of settings other than
    `key`) that hold some of them, and try again. None if they still cannot be had: servers in use (or
    draining) or other jobs hold them."""
    scope = jobinfo.gpu_lock_scope()
    if (claimed := jobinfo.try_claim_gpus(gpus, among, scope)) is not None:
        return claimed
    if stop_idle(lambda e: e.key != key and bool(set(e.gpus) & set(among)), "it holds GPUs this job needs"):
        return jobinfo.try_claim_gpus(gpus, among, scope)
    return None


def claim_gpus(gpus: int) -> dict[str, BinaryIO] | None:
    """For a job that runs its own engine (regenerate): its GPUs, locked, stopping only idle servers that
    hold them (`try_claim_gpus`), waiting while others use them; None when there is nothing to claim."""
    among = jobinfo.gpus_to_claim(gpus)
    if among is None:
        return None
    waiting = False
    while (claimed := try_claim_gpus(gpus, among)) is None:
        if not waiting:
            logger.info("waiting for %d free GPUs of %s (jobs or engines in use hold them)", gpus, among)
            waiting = True
        time.sleep(jobinfo.POLL_S)
    return claimed


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
        return RemoteEngine(entry, busy, try_lock(Path(entry.draining), shared=True) if entry.draining else None,
                            conn, loaded_here=False)
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
        draining=str(scope / f"{server_id}.draining"), gpus=sorted(claimed or {}), owner=run_owner(),
    )
    busy = try_lock(Path(entry.busy))  # new files: nobody else can hold them
    draining = try_lock(Path(entry.draining), shared=True)
    spec_path = scope / f"{server_id}.spec.json"
    atomic_write_text(spec_path, json.dumps({**spec, "entry": asdict(entry)}))
    env = with_run_group(dict(os.environ))
    if claimed is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(claimed)
    logger.info("starting engine %s on %s (GPUs %s); its log: %s", server_id, entry.node,
                env.get("CUDA_VISIBLE_DEVICES", "none"), entry.log)
    with open(entry.log, "ab") as log:  # a session of its own: it outlives this job (server.py)
        process = subprocess.Popen(
            [sys.executable, "-m", "eagle3data.engine.server", str(spec_path)], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            pass_fds=[lock.fileno() for lock in (claimed or {}).values()],
        )
    for lock in (claimed or {}).values():
        lock.close()  # the server holds the GPUs now
    while not Path(entry.path).exists():
        if process.poll() is not None:
            busy.close()
            draining.close()
            raise EngineError(f"engine {server_id} exited with code {process.returncode} while starting; "
                              f"the end of its log ({entry.log}):\n{log_tail(entry.log)}")
        time.sleep(POLL_S)
    entry = ServerEntry(**json.loads(Path(entry.path).read_text()))
    sys.stderr.write(Path(entry.log).read_text(errors="replace"))  # the engine's start, in this job's log
    conn = connect(entry)
    if conn is None:
        busy.close()
        draining.close()
        raise EngineError(f"engine {server_id} is ready but refuses connections; its log: {entry.log}")
    return RemoteEngine(entry, busy, draining, conn, loaded_here=True)


def connect(entry: ServerEntry):
    try:
        return Client(entry.socket, family="AF_UNIX", authkey=bytes.fromhex(entry.authkey))
    except (OSError, EOFError):
        return None


def stop_idle(which, why: str = "asked to stop") -> int:
    """Stop this user's idle servers on this node that `which` selects, waiting until each has exited;
    how many. Idle: no job holds it (`busy`) and no job's files are still landing (`draining`)."""
    stopped = 0
    for entry in entries():
        if not which(entry) or (busy := try_lock(Path(entry.busy))) is None:
            continue
        draining = try_lock(Path(entry.draining)) if entry.draining else None
        if entry.draining and draining is None:  # a job's last files are still landing: not idle
            busy.close()
            continue
        with busy:
            conn = connect(entry)
            Path(entry.path).unlink(missing_ok=True)
            if conn is None:
                continue
            with conn:
                try:
                    conn.send(Stop())
                    conn.recv()
                except (EOFError, ConnectionError):
                    pass
            wait_exited(entry.pid)
            logger.info("stopped idle engine %s on %s (started by %s of %s): %s", entry.id, entry.node,
                        entry.started_by, entry.run_dir, why)
            stopped += 1
        if draining is not None:
            draining.close()
    return stopped


def stop_idle_of_run(run_dir: str) -> int:
    """At the end of a successful run: its engines have nothing left to do."""
    run = str(Path(run_dir).resolve())
    return stop_idle(lambda entry: entry.run_dir == run, "its run is done")


def wait_exited(pid: int) -> None:
    """Wait for a stopped (idle) server to exit. One that does not is reported, not killed: it has
    nothing in flight, and its own lifecycle (server.py) ends it."""
    import psutil

    try:
        psutil.Process(pid).wait(STOP_WAIT_S)
    except psutil.NoSuchProcess:
        return
    except psutil.TimeoutExpired:
        logger.warning("engine process %d did not exit within %.0f s of being asked to stop; it is out of "
                       "the registry and left to end on its own", pid, STOP_WAIT_S)


def log_tail(path: str, chars: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"(unreadable: {exc})"
