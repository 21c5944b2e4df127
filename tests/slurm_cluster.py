"""Start and stop a real single-node SLURM (``.ci/slurm.sh``) around tests that submit jobs.

Tests of the SLURM executor path need a live slurmctld/slurmd; this wraps the CI script so that a
pytest fixture can do ``with local_slurm(tmp_path) as conf: ...``. Raises :class:`SlurmUnavailable`
when SLURM is not installed (or we are not root); callers may turn that into a skip only when
``EAGLE3_ALLOW_SKIP_SLURM=1`` (see :func:`skip_allowed`), otherwise it is a failure.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "slurm.sh"
ALLOW_SKIP_ENV = "EAGLE3_ALLOW_SKIP_SLURM"
DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scancel")
# The daemons are the machine's (munge's socket, the ports): one local cluster at a time, whichever test
# process (pytest-xdist worker, another session) starts it.
LOCK = Path(tempfile.gettempdir()) / "eagle3data-local-slurm.lock"


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be started on this machine (not installed, or not root)."""


def skip_allowed() -> bool:
    """True when the environment allows skipping SLURM tests instead of failing them."""
    return os.environ.get(ALLOW_SKIP_ENV) == "1"


def unavailable_reason() -> str | None:
    """Why a local SLURM cannot be started here, or None if it can."""
    if os.geteuid() != 0:
        return "local SLURM needs root (slurmd, mknod); run the tests as root"
    missing = [p for p in DAEMONS if not os.access(p, os.X_OK)]
    missing += [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return f"SLURM is not installed (missing: {', '.join(missing)}); run: .ci/slurm.sh install"
    return None


def _run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True)


@contextlib.contextmanager
def local_slurm(tmp_dir: str | Path) -> Iterator[Path]:
    """Run a local SLURM under ``tmp_dir/slurm``; yields the slurm.conf path, set as SLURM_CONF."""
    reason = unavailable_reason()
    if reason:
        raise SlurmUnavailable(reason)
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, the cluster stopped
        with _started(Path(tmp_dir) / "slurm") as conf:
            yield conf


@contextlib.contextmanager
def _started(state: Path) -> Iterator[Path]:
    started = _run("start", state)
    if started.returncode != 0:
        _run("stop", state)  # start cleans up after itself; this is a second safety net
        raise RuntimeError(f".ci/slurm.sh start {state} failed:\n{started.stderr}")
    prefix = "export SLURM_CONF="
    conf = next((ln[len(prefix):] for ln in started.stdout.splitlines() if ln.startswith(prefix)), None)
    if conf is None:
        _run("stop", state)
        raise RuntimeError(f"no '{prefix}...' line from .ci/slurm.sh start:\n{started.stdout}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield Path(conf)
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        stopped = _run("stop", state)
        if stopped.returncode != 0:
            raise RuntimeError(f".ci/slurm.sh stop {state} failed:\n{stopped.stderr}")


def wait_job(job_id: str, timeout: float = 60) -> str:
    """Poll squeue (finished jobs stay listed for MinJobAge) until the job leaves PENDING/RUNNING."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"],
                               capture_output=True, text=True).stdout.strip()
        if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(0.5)
    raise TimeoutError(f"SLURM job {job_id} still not finished after {timeout} s")
