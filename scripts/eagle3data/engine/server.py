"""One capturing vLLM engine that outlives the extract job that started it and serves the next shards.

Loading Kimi-K2.5 takes 20+ minutes; an engine per extract job made the shard size a trade between
re-run granularity and load time. This process loads the engine once and then runs the prefill of
whichever extract job holds it (engine/pool.py finds, claims and starts servers), one job at a time,
until it has been idle for `engine.keep_alive_s` or is asked to stop. Each job keeps its own outputs,
log and failure record; the server only turns token ids into states files written by the connector
(capture/connector.py), exactly as the job's own engine did.

Run as `python -m eagle3data.engine.server SPEC.json` (engine_pool.start_server writes the spec).

Its lifecycle, chosen so that it outlives a job but never its run:
- It runs in a session of its own, so a signal to the job that started it (or to that job's process
  group: Snakemake, SLURM or an operator stopping the job) does not stop an engine that other jobs of
  the run are about to use, and the job's reaper (engine/reaper.py) leaves it alone.
- It belongs to a run: the Snakemake process that scheduled the job that started it (pool.run_owner),
  and then to the run of each job it serves (a re-run that takes it over owns it from then on). While
  its run lives, it stops after `keep_alive_s` without a job (a failed run's re-run finds it loaded).
  Once its run is gone for good (ended, killed with any signal, or its SLURM job over) and no new run
  took it within ORPHAN_KEEP_ALIVE_S (or keep_alive_s, if shorter) of idleness, it stops: a dead run
  never holds a node's memory or GPUs for longer than that.
- It stops only when idle: no job holds it and no job's last files are still landing (pool.py's `busy`
  and `draining` locks, which it takes itself before stopping).
- Its own vLLM processes (engine core, workers) die with it, whatever ends it, SIGKILL included: it is
  guarded by a reaper of its own. SIGTERM, SIGINT and SIGHUP end it at once, logged.
- A crash of the engine alone fails only the job it was serving, which sees its connection close.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Client, Listener
from pathlib import Path

from eagle3data.engine import start as engine_mod
from eagle3data.engine.pool import LOG_REPLY_BYTES, Generate, Serve, ServerEntry, Stop, owner_alive
from eagle3data.engine.reaper import guard
from eagle3data.engine.jobinfo import try_lock
from eagle3data.contracts.layers import Capture
from eagle3data.utils.logs import get_logger, redirect_output_to
from eagle3data.storage.store import atomic_write_text
from eagle3data.utils import faults

logger = get_logger(__name__)

ORPHAN_KEEP_ALIVE_S = 60.0  # idle seconds an engine whose run is gone waits for a re-run to take it
ORPHAN_KEEP_ALIVE_ENV = "EAGLE3DATA_TEST_ORPHAN_KEEP_ALIVE_S"  # a test's shorter wait


class Server:
    def __init__(self, spec: dict):
        self.spec = spec
        self.entry = ServerEntry(**spec["entry"])
        self.entry.pid = os.getpid()
        self.log_path = Path(self.entry.log)
        self.idle_since = time.monotonic()
        self.serving = False
        self.stopping = False
        self.shards = 0
        self.shard = ""  # the job being served

    def start(self) -> None:
        began = time.perf_counter()
        self.llm = engine_mod.start_engine(self.spec["kwargs"], self.spec["cpu_kv_cache_gib"])
        captures = [Capture(c["layer"], c["point"]) for c in self.spec["captures"]]
        engine_mod.verify_engine(self.llm, captures, self.spec["kwargs"]["dtype"],
                                 self.spec["kwargs"]["tensor_parallel_size"])
        scheduler = self.llm.llm_engine.vllm_config.scheduler_config
        self.entry.max_num_batched_tokens = scheduler.max_num_batched_tokens
        self.entry.chunked_prefill = bool(scheduler.enable_chunked_prefill)
        self.entry.start_seconds = time.perf_counter() - began
        self.listener = Listener(self.entry.socket, family="AF_UNIX", authkey=bytes.fromhex(self.entry.authkey))
        # The entry file says "ready": clients look for it (engine_pool.acquire), the starter waits for it.
        atomic_write_text(self.entry.path, json.dumps(asdict(self.entry)))
        logger.info("engine %s ready on %s in %.1f s; idle after %s s it stops", self.entry.id,
                    self.entry.node, self.entry.start_seconds, self.spec["keep_alive_s"])

    def serve(self) -> None:
        threading.Thread(target=self._stop_when_idle, daemon=True).start()
        while not self.stopping:
            with self.listener.accept() as conn:
                self.serving = True
                try:
                    self._serve_client(conn)
                except (EOFError, ConnectionError, BrokenPipeError):
                    logger.warning("engine %s: its client went away mid-request", self.entry.id)
                finally:
                    self.serving = False
                    self.idle_since = time.monotonic()

    def _serve_client(self, conn) -> None:
        while not self.stopping:
            try:
                message = conn.recv()
            except EOFError:
                return
            if isinstance(message, Stop):
                self.stopping = True
                conn.send(("ok",))
            elif isinstance(message, Serve):
                self._serve_shard(message)
                conn.send(("ok", self.shards))
            elif isinstance(message, Generate):
                conn.send(self._generate(*message))
            else:
                conn.send(("error", f"unknown request {message!r:.200}"))

    def _serve_shard(self, request: Serve) -> None:
        """A job holds the server now; a run other than its owner's takes it over (the test faults of the
        run that started it, utils/faults.py, are not the new run's)."""
        self.shard = request.shard
        if request.owner != self.entry.owner:
            logger.info("engine %s: now owned by the run of process %d", self.entry.id, request.owner[0])
            self.entry.owner = request.owner
            faults.forget()
        self.shards += 1
        logger.info("engine %s: serving %s (shard %d of this engine)", self.entry.id, request.shard,
                    self.shards)

    def _generate(self, token_ids: list[list[int]], paths: list[str], log_probs: list[bool]) -> tuple:
        """("ok", kv_transfer_params per prompt, this request's lines of the server log, the engine's
        log-probability of each next prompt token for the prompts `log_probs` flags, else None) or
        ("error", ...). The log-probabilities are the parity gate's witness (validate/parity.py)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        offset = self.log_path.stat().st_size
        faults.point(f"engine:generate:{self.shard}")
        try:
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
            params = [SamplingParams(max_tokens=1, prompt_logprobs=0 if wanted else None,
                                     extra_args={"kv_transfer_params": {"hidden_states_path": p}})
                      for p, wanted in zip(paths, log_probs)]
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            replies = [output.kv_transfer_params for output in outputs]
            next_token = [prompt_log_probs(output, ids) if wanted else None
                          for output, ids, wanted in zip(outputs, token_ids, log_probs)]
        except Exception:
            return ("error", traceback.format_exc())
        return ("ok", replies, read_log_since(self.log_path, offset), next_token)

    def _stop_when_idle(self) -> None:
        """Stop after keep_alive_s without a client (ORPHAN_KEEP_ALIVE_S, if shorter, once its run is
        gone), unless a job claimed the server meanwhile or a job's last files are still landing: the
        server takes its own busy lock, then its draining lock, so such a job keeps it alive."""
        orphaned, orphan_keep_alive = False, float(os.environ.get(ORPHAN_KEEP_ALIVE_ENV, ORPHAN_KEEP_ALIVE_S))
        while True:
            time.sleep(0.5)
            keep_alive = self.spec["keep_alive_s"]
            if not owner_alive(self.entry.owner):
                if not orphaned:
                    logger.info("engine %s: the run that owns it (process %d) is gone; it stops once idle "
                                "for %.0f s", self.entry.id, self.entry.owner[0],
                                min(keep_alive, orphan_keep_alive))
                orphaned = True
                keep_alive = min(keep_alive, orphan_keep_alive)
            elif orphaned:
                orphaned = False  # a re-run took it over
            if self.serving or time.monotonic() - self.idle_since < keep_alive:
                continue
            lock = try_lock(Path(self.entry.busy))
            if lock is None:
                continue
            draining = try_lock(Path(self.entry.draining)) if self.entry.draining else lock
            if draining is None:
                lock.close()
                continue
            logger.info("engine %s: idle for %s s, stopping", self.entry.id, keep_alive)
            Path(self.entry.path).unlink(missing_ok=True)  # no new client finds it
            self.stopping = True
            self._held = (lock, draining)  # released when this process exits
            with Client(self.entry.socket, family="AF_UNIX", authkey=bytes.fromhex(self.entry.authkey)):
                pass  # wakes accept()
            return

    def close(self) -> None:
        Path(self.entry.path).unlink(missing_ok=True)
        self.listener.close()  # removes the socket file
        Path(self.entry.busy).unlink(missing_ok=True)  # a job that opens it anew finds no server: harmless
        if self.entry.draining:
            Path(self.entry.draining).unlink(missing_ok=True)
        del self.llm  # vLLM shuts its engine core and workers down
        logger.info("engine %s stopped after %d shards", self.entry.id, self.shards)


def prompt_log_probs(output, token_ids: list[int]) -> list[float]:
    """The engine's log-probability of each prompt token after the first, given the tokens before it."""
    return [float(position[token].logprob) for position, token in zip(output.prompt_logprobs[1:], token_ids[1:])]


def read_log_since(path: Path, offset: int) -> str:
    """What the server and vLLM's processes logged since `offset` (at most LOG_REPLY_BYTES, the end)."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(offset, size - LOG_REPLY_BYTES))
        return f.read().decode(errors="replace")


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    Path(spec_path).unlink()
    redirect_output_to(spec["entry"]["log"])
    guard(f"engine server {spec['entry']['id']}")  # its vLLM processes die with it
    server = Server(spec)
    server.start()
    try:
        server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    main(sys.argv[1])
