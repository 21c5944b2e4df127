"""Host buffers for the states of one request each, allocated once when the engine starts and reused.

vLLM's hidden-states connector allocates fresh page-locked memory for every finished request. Pinning
is slow (measured: 128 fresh 16 MB buffers took 0.8 s) and it runs on the engine's own thread
between forward passes, so the GPU waits: the extract stage lost 2-5 % of prefill speed inside
generate(). A fixed set of buffers of the longest request's size, taken per request and given back
once its file is written, pins nothing while the engine runs and bounds the host memory in flight.
When all are in use the engine waits for a writer to finish: the disk is then the limit, and a
warning says so.
"""

from __future__ import annotations

import queue
import time

import torch

from eagle3data.utils.logs import get_logger

logger = get_logger(__name__)


class PinnedBuffers:
    """`count` buffers of `[max_tokens, *per_token]`; `take(tokens)` gives one (blocking while none is
    free) and the `[tokens, *per_token]` view to fill; `give_back(buffer)` returns it."""

    def __init__(self, count: int, max_tokens: int, per_token: tuple[int, ...], dtype: torch.dtype,
                 pin: bool = True):
        began = time.perf_counter()
        self.max_tokens, self.count = max_tokens, count
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(count):
            self._free.put(torch.empty((max_tokens, *per_token), dtype=dtype, pin_memory=pin))
        self.waited_seconds = 0.0
        size = count * max_tokens * torch.Size(per_token).numel() * dtype.itemsize
        logger.info("%d %s host buffers of [%d, %s] %s (%.2f GiB) in %.2f s", count,
                    "pinned" if pin else "plain", max_tokens, ", ".join(map(str, per_token)), dtype,
                    size / 2**30, time.perf_counter() - began)

    def take(self, tokens: int, request: str = "a request") -> tuple[torch.Tensor, torch.Tensor]:
        """(buffer, its first `tokens` rows): fill the view, hand the buffer to `give_back` when done.
        `request` names it in the error when it does not fit."""
        if not 0 < tokens <= self.max_tokens:
            raise ValueError(f"{request}: {tokens} tokens does not fit buffers of {self.max_tokens} tokens")
        try:
            buffer = self._free.get_nowait()
        except queue.Empty:
            began = time.perf_counter()
            buffer = self._free.get()
            first_wait = self.waited_seconds == 0
            self.waited_seconds += time.perf_counter() - began
            if first_wait:
                logger.warning("all %d host buffers were waiting to be written: the engine waited %.3f s for "
                               "the writers (the disk is slower than prefill here, or raise "
                               "engine.host_buffer_gib)", self.count, self.waited_seconds)
        return buffer, buffer[:tokens]

    def give_back(self, buffer: torch.Tensor) -> None:
        self._free.put(buffer)
