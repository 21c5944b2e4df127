"""vLLM's example hidden-states connector, its private members under names of ours: the one module that
touches them.

Our connector (connector.py) builds on vLLM's example connector, which is no public API: its module, its
metadata and its members (the KV cache, the writer threads, the tracked copies and writes) may change in
any release, which a version pin alone does not say. Here they are reached in one place, and
tests/test_vllm_surface.py checks each against the installed vLLM, naming what it lacks. The convention
that test relies on: a method here with a leading underscore overrides vLLM's own hook; a public one is
ours, and connector.py uses only those, vLLM's public connector API and private names of its own.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    extract_from_kv_cache,  # noqa: F401 (the cache's states at slots: connector.py's, through here)
)


class Save(NamedTuple):
    """A request that finished: its states go to `filename` (vLLM's PendingSave, as connector.py reads it)."""

    req_id: str
    filename: str
    token_ids: torch.Tensor  # on the host
    block_ids: list[int]


class StockConnector(ExampleHiddenStatesConnector):
    """vLLM's example connector with what our connector needs of it, named."""

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """The cache the captured states are written to, `[blocks, n_captures, block_size, H]`."""
        return self._kv_cache

    @property
    def writes_files(self) -> bool:
        """Whether this worker writes the files: TP rank 0 holds every capture's states."""
        return self._is_tp_rank_zero

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def max_model_len(self) -> int:
        return self._vllm_config.model_config.max_model_len

    def extra_config(self, key: str, default):
        """`kv_connector_extra_config[key]` (engine/start.py sets it), or `default`."""
        return self._kv_transfer_config.get_from_extra_config(key, default)

    def step_saves(self) -> list[Save]:
        """The requests this step's metadata says finished (none without metadata)."""
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            return []
        return [_save(pending) for pending in metadata.pending_saves]

    def copy_stream(self) -> torch.cuda.Stream:
        return self._get_copy_stream()

    def take_lock_fd(self, req_id: str) -> int | None:
        """The request's file lock, vLLM's to open and ours to close once its file is written."""
        return self._lock_fds.pop(req_id, None)

    def copying(self, req_id: str, copied) -> None:
        """Report the request done (vLLM's get_finished) once `copied`, an event, is reached."""
        self._req_copy_events[req_id] = copied

    def submit_write(self, req_id: str, write, *args) -> None:
        """`write(*args)` on vLLM's writer threads, tracked as the request's write (its failure logged)."""
        if req_id in self._req_futures:
            raise RuntimeError(f"request {req_id} was already being written")
        future = self._executor.submit(write, *args)
        self._req_futures[req_id] = future
        future.add_done_callback(partial(self._on_write_done, req_id))

    def save_request(self, save: Save) -> None:
        """Copy and write one finished request's states: vLLM's get_finished asks for each (connector.py)."""
        raise NotImplementedError

    def _submit_async_write(self, pending) -> None:
        self.save_request(_save(pending))


def _save(pending) -> Save:
    return Save(pending.req_id, pending.filename, pending.token_ids, pending.block_ids)
