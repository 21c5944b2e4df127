"""Logging that is visible in every process, vLLM's workers included.

vLLM configures handlers for its own `vllm` logger only. A module logger of ours inside a worker
process has no handler there, so Python's last-resort handler drops its INFO records silently (people
then fall back to `print`). `get_logger` attaches one stderr handler to the `eagle3data` logger in
whichever process imports it; stderr is the rule's log file (see `redirect_output_to`), so worker lines
land next to the driver's.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [eagle3data pid=%(process)d %(processName)s] %(message)s"


def get_logger(name: str) -> logging.Logger:
    """A logger under `eagle3data` that writes INFO and above to stderr in any process."""
    root = logging.getLogger("eagle3data")
    if not any(getattr(h, "_eagle3data", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._eagle3data = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        root.setLevel(os.environ.get("EAGLE3DATA_LOG_LEVEL", "INFO"))
        root.propagate = False
    return logging.getLogger(name if name.startswith("eagle3data") else f"eagle3data.{name}")


def redirect_output_to(log_path: str) -> None:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at `log_path`.

    Done at the descriptor level so that child processes (vLLM's engine core and workers) inherit it:
    everything they print or log reaches the rule's `log:` file.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    if (started := seconds_since_start()) is not None:  # each job's fixed cost, visible in its log
        get_logger(__name__).info("process up %.2f s after its start (interpreter, imports)", started)


def seconds_since_start() -> float | None:
    """Seconds since this process started, from Linux's /proc (None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
