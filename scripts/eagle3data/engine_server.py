"""One capturing vLLM engine that outlives the extract job that started it and serves the next shards.

Loading Kimi-K2.5 takes 20+ minutes; an engine per extract job made the shard size a trade between
re-run granularity and load time. This process loads the engine once and then runs the prefill of the
extract jobs that hold it (engine_pool.py finds, claims and starts servers) until it has been idle for
`engine.keep_alive_s` or is asked to stop. Each job keeps its own outputs, log and failure record; the
server only turns token ids into states files written by the connector (connector.py), exactly as the
job's own engine did.

The engine is fed, not called: a job sends its batches ahead (`engine.batches_in_flight`) and hands the
server on once it has sent its last one, so the next shard's requests join the engine's queue while
this shard's last ones run. One `LLM.generate()` per batch drained the engine at every batch's end (a
last step part empty, then nothing scheduled until the job's next call arrived). Replies go back to
each job in the order of its batches.

Run as `python -m eagle3data.engine_server SPEC.json` (engine_pool.start_server writes the spec). The
server stays in the process group of the job that started it, so whatever kills the whole run (a node
crash, `kill -9` of snakemake, the end of a SLURM allocation) kills the engine too; a crash of the
engine alone fails only the jobs it was serving, which see their connections close.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict
from pathlib import Path

from multiprocessing.connection import Listener

from eagle3data import engine as engine_mod
from eagle3data.engine_pool import LOG_REPLY_BYTES, ServerEntry
from eagle3data.jobinfo import try_lock
from eagle3data.layers import Capture
from eagle3data.logs import get_logger, redirect_output_to
from eagle3data.store import atomic_write_text
from eagle3data.testing import kill_engine_point, kill_point

logger = get_logger(__name__)
IDLE_WAKE_S = 0.5  # how often an idle engine loop looks for work or a stop


class Client:
    """One job's connection: the shard it serves, and its batches in the order it sent them."""

    def __init__(self, conn):
        self.conn, self.shard, self.kill_spec = conn, "", None
        self.batches: deque[Batch] = deque()
        self._send_lock = threading.Lock()  # replies come from the engine loop, "shard" answers from the reader

    def send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self.conn.send(message)
            except (OSError, EOFError):
                logger.warning("a job went away before its reply (shard %s)", self.shard or "?")

    def send_finished(self) -> None:
        """Reply for the batches at the front that are done: a job reads its replies in its own order."""
        while self.batches and self.batches[0].done():
            self.send(self.batches.popleft().reply())


class Batch:
    """A `generate` message: each prompt's kv_transfer_params as its request finishes, or the error."""

    def __init__(self, client: Client, size: int, log_path: Path):
        self.client, self.log_path = client, log_path
        self.log_offset = log_path.stat().st_size
        self.replies, self.remaining, self.error = [None] * size, size, None

    def done(self) -> bool:
        return self.error is not None or self.remaining == 0

    def reply(self) -> tuple:
        """("ok", kv_transfer_params per prompt, the server log's lines since it came) or ("error", ...)."""
        if self.error is not None:
            return ("error", self.error)
        return ("ok", self.replies, read_log_since(self.log_path, self.log_offset))


class Server:
    def __init__(self, spec: dict):
        self.spec = spec
        self.entry = ServerEntry(**spec["entry"])
        self.entry.pid = os.getpid()
        self.log_path = Path(self.entry.log)
        self.inbox: queue.Queue = queue.Queue()  # (client, token ids, paths); paths None: a stop
        self.requests: dict[str, tuple[Batch, int]] = {}  # vLLM request id -> its batch and place in it
        self.request_ids = itertools.count()
        self.lock = threading.Lock()
        self.clients = self.shards = 0
        self.idle_since = time.monotonic()
        self.stopper = None  # once stopping: the client that asked (None: the idle timer), answered at exit
        self.stopping = False
        self.idle_lock = None  # the busy lock, once the idle timer stops the server: held until it exits

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
        """Accept jobs and read their messages in threads; run the engine in this one until stopped."""
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._stop_when_idle, daemon=True).start()
        while not (self.stopping and self._drained()):
            self._admit(wait=not self.requests)
            if self.requests:
                self._step()
        if self.stopper is not None:
            self.stopper.send(("ok",))

    def _drained(self) -> bool:
        """Nothing in flight, and no job connected but the one that asked to stop: a job keeps its
        connection until its last reply, so its batches sent before the stop are all in by then."""
        with self.lock:
            others = self.clients - (self.stopper is not None)
        return not self.requests and self.inbox.empty() and others == 0

    def _accept(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return  # closed: the server is stopping
            with self.lock:
                self.clients += 1
            threading.Thread(target=self._read, args=(Client(conn),), daemon=True).start()

    def _read(self, client: Client) -> None:
        """One job's messages: its shard (answered here), its batches and a stop (for the engine loop)."""
        try:
            while True:
                op, *args = client.conn.recv()
                if op == "shard":
                    client.shard, client.kill_spec = args
                    with self.lock:
                        self.shards += 1
                        served = self.shards
                    logger.info("engine %s: serving %s (shard %d of this engine)", self.entry.id, client.shard,
                                served)
                    client.send(("ok", served))
                elif op == "generate":
                    self.inbox.put((client, *args))
                elif op == "stop":
                    self.inbox.put((client, None, None))
                else:
                    client.send(("error", f"unknown request {op!r}"))
        except (EOFError, OSError):
            if client.batches:
                logger.warning("engine %s: the job of %s went away with %d batches in flight; they run to "
                               "their end", self.entry.id, client.shard, len(client.batches))
        finally:
            client.conn.close()
            with self.lock:
                self.clients -= 1
                self.idle_since = time.monotonic()

    def _admit(self, wait: bool) -> None:
        """Add to the engine what jobs sent since the last step (waiting a little for it when idle)."""
        try:
            item = self.inbox.get(timeout=IDLE_WAKE_S) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            client, token_ids, paths = item
            if paths is None:
                self.stopping, self.stopper = True, client
            else:
                self._add_batch(client, token_ids, paths)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add_batch(self, client: Client, token_ids: list[list[int]], paths: list[str]) -> None:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        kill_point(f"engine:generate:{client.shard}")
        kill_engine_point(f"engine:generate:{client.shard}", client.kill_spec)
        logger.info("engine %s: a batch of %d samples of %s; %d requests in the engine before it", self.entry.id,
                    len(paths), client.shard, len(self.requests))
        batch = Batch(client, len(paths), self.log_path)
        client.batches.append(batch)
        added = []
        try:
            for place, (ids, path) in enumerate(zip(token_ids, paths)):
                params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": path}})
                params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks: one output, at the end
                request_id = str(next(self.request_ids))
                self.llm.llm_engine.add_request(request_id, tokens_input(ids), params)  # as rendered
                self.requests[request_id] = (batch, place)
                added.append(request_id)
        except Exception:
            batch.error = traceback.format_exc()
            self._drop(added)
            client.send_finished()

    def _step(self) -> None:
        """One engine step; each finished request's reply goes into its batch, and finished batches back
        to their jobs. If the engine fails, every batch in flight fails with its error."""
        try:
            outputs = self.llm.llm_engine.step()
        except Exception:
            error = traceback.format_exc()
            failed = {batch for batch, _ in self.requests.values()}
            for batch in failed:
                batch.error = error
            self._drop(list(self.requests))
            for client in {batch.client for batch in failed}:
                client.send_finished()
            return
        clients = set()
        for output in outputs:
            if output.finished and output.request_id in self.requests:  # (not one aborted meanwhile)
                batch, place = self.requests.pop(output.request_id)
                batch.replies[place] = output.kv_transfer_params
                batch.remaining -= 1
                clients.add(batch.client)
        for client in clients:
            client.send_finished()

    def _drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)
        try:
            self.llm.llm_engine.abort_request(request_ids)
        except Exception:
            logger.exception("engine %s: aborting %d requests failed", self.entry.id, len(request_ids))

    def _busy(self) -> bool:
        return bool(self.clients or self.requests or not self.inbox.empty())

    def _stop_when_idle(self) -> None:
        """Stop after keep_alive_s without a job or work, unless a job claimed the server meanwhile: the
        server takes its own busy lock first, so a job holding it keeps the server alive."""
        while True:
            time.sleep(0.5)
            with self.lock:
                if self._busy():
                    self.idle_since = time.monotonic()
                if time.monotonic() - self.idle_since < self.spec["keep_alive_s"]:
                    continue
            self.idle_lock = try_lock(Path(self.entry.busy))
            if self.idle_lock is None:
                continue
            logger.info("engine %s: idle for %s s, stopping", self.entry.id, self.spec["keep_alive_s"])
            Path(self.entry.path).unlink(missing_ok=True)  # no new client finds it
            self.inbox.put((None, None, None))
            return

    def close(self) -> None:
        Path(self.entry.path).unlink(missing_ok=True)
        self.listener.close()  # removes the socket file
        Path(self.entry.busy).unlink(missing_ok=True)  # a job that opens it anew finds no server: harmless
        del self.llm  # vLLM shuts its engine core and workers down
        logger.info("engine %s stopped after %d shards", self.entry.id, self.shards)


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
    server = Server(spec)
    server.start()
    try:
        server.serve()
    finally:
        server.close()


if __name__ == "__main__":
    main(sys.argv[1])
