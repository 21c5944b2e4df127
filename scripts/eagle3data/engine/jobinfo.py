"""Where a job runs: its own GPUs claimed, and one log line naming node, GPUs and SLURM job id.

Data-parallel engines are several extract jobs side by side, each asking for `gpu=<its GPU count>`.
A SLURM job submitted by profiles/slurm sees exactly its GPUs in CUDA_VISIBLE_DEVICES. Snakemake's
local executor (on a workstation, or inside one `salloc`/`sbatch` allocation of a whole node) only
counts `gpu` resources (`--resources gpu=8`) and sets no CUDA_VISIBLE_DEVICES, so every job would see
every GPU and all engines would start on the first one. `start_job` therefore claims the job's GPUs
among those visible, with one lock file per GPU held until the process exits, and narrows
CUDA_VISIBLE_DEVICES to them. Locks are scoped to the node and the SLURM allocation (or "local"); a job
that sees exactly its GPUs takes no lock. The locks and the engine registry (engine/pool.py) live under a
directory of this user's (`user_dir`: mode 0700, refused if another user owns it), never in a directory
every user of the node can write to. An extract job claims nothing itself: the engine server it
starts (engine/pool.py) gets the claimed GPUs' locks and holds them for as long as it lives.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from eagle3data.utils.logs import get_logger

logger = get_logger(__name__)

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one entry per GPU the driver shows this process
USER_ROOT = Path(tempfile.gettempdir()) / f"eagle3data-{os.getuid()}"  # this user's, mode 0700
LOCK_ROOT = USER_ROOT / "gpu-locks"
ENGINE_ROOT = USER_ROOT / "engines"  # engine/pool.py's registries
POLL_S = 1.0  # how often a waiting job tries again
_held: dict[str, BinaryIO] = {}  # this process's claimed GPUs (the locks live as long as the files)


class GpuClaimError(RuntimeError):
    """A job's GPUs cannot be claimed: too few are visible, or SLURM bound none to it."""


def node_scope() -> str:
    """Node and SLURM allocation (or "local"): what GPU locks and engine servers are shared within."""
    return f"{socket.gethostname()}-{os.environ.get('SLURM_JOB_ID') or 'local'}"


def gpus_to_claim(gpus: int) -> list[str] | None:
    """The visible GPUs among which a job must lock its `gpus` before it uses them. None when there is
    nothing to claim: no GPUs asked for, or a SLURM job that sees exactly its own (SLURM bound them to it).
    A local run claims even when it sees exactly as many as it asks for: another job may be using them."""
    if not gpus:
        return None
    slurm_job = os.environ.get("SLURM_JOB_ID")
    visible = visible_gpus(slurm_job)
    return None if slurm_job and len(visible) == gpus else visible


def gpu_lock_scope() -> Path:
    return user_dir(LOCK_ROOT / node_scope())


def user_dir(path: Path) -> Path:
    """`path` (under USER_ROOT) made if missing, every level from USER_ROOT down private to this user
    (0700). A USER_ROOT that another user owns, or that is a symlink, is refused: someone else could then
    hold our locks, list our engines or plant files among them."""
    USER_ROOT.mkdir(mode=0o700, exist_ok=True)
    info = USER_ROOT.lstat()
    if USER_ROOT.is_symlink() or info.st_uid != os.getuid():
        raise GpuClaimError(f"{USER_ROOT} is not a directory of this user's (uid {os.getuid()}): remove it "
                            f"or set TMPDIR to a directory of your own")
    if info.st_mode & 0o077:
        USER_ROOT.chmod(0o700)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def claim_job_gpus(gpus: int) -> dict[str, BinaryIO] | None:
    """Lock `gpus` GPUs among those to claim (gpus_to_claim), waiting while other jobs hold them; GPU ->
    held lock file. None when there is nothing to claim."""
    among = gpus_to_claim(gpus)
    return None if among is None else claim_gpus(gpus, among, gpu_lock_scope())


def start_job(gpus: int, claim: bool = True, claimed: dict[str, BinaryIO] | None = None) -> None:
    """Log node, GPUs and SLURM job id; with `claim`, claim `gpus` GPUs for this process first (an
    extract job leaves the claim to the engine server it starts: engine/pool.py), unless the caller
    `claimed` them already (pool.claim_gpus, which may stop idle engines holding them)."""
    if claimed is None and claim:
        claimed = claim_job_gpus(gpus)
    if claimed is not None:
        _held.update(claimed)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(claimed)
    logger.info(
        "job on node %s, SLURM job %s, %d GPUs requested, CUDA_VISIBLE_DEVICES=%s",
        socket.gethostname(), os.environ.get("SLURM_JOB_ID") or "none (local run)", gpus,
        os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
    )


def visible_gpus(slurm_job: str | None) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES, else every GPU of the machine."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    if slurm_job:
        raise GpuClaimError(
            f"SLURM job {slurm_job} asked for GPUs but has no CUDA_VISIBLE_DEVICES: the cluster does not "
            "bind GPUs to jobs (gres.conf needs File= lines), so jobs sharing a node would share GPUs"
        )
    found = sorted(NVIDIA_GPUS.iterdir()) if NVIDIA_GPUS.is_dir() else []
    if not found:
        raise GpuClaimError(
            f"this job asks for GPUs but {NVIDIA_GPUS} lists none and CUDA_VISIBLE_DEVICES is unset; "
            "set CUDA_VISIBLE_DEVICES to the GPUs extract jobs may use"
        )
    return [str(i) for i in range(len(found))]


def try_lock(path: Path, shared: bool = False) -> BinaryIO | None:
    """An exclusive (or `shared`) lock on `path`, held as long as the returned file stays open; None if
    taken (exclusively, or at all for an exclusive one)."""
    handle = open(path, "ab")
    try:
        fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def try_claim_gpus(n: int, visible: list[str], scope: Path) -> dict[str, BinaryIO] | None:
    """Lock `n` of `visible` under `scope` now, all or nothing; GPU -> open lock file, or None."""
    if n > len(visible):
        raise GpuClaimError(f"this job asks for {n} GPUs, only {len(visible)} are visible: {visible}")
    scope.mkdir(mode=0o700, parents=True, exist_ok=True)
    held: dict[str, BinaryIO] = {}
    for gpu in visible:
        lock = try_lock(scope / re.sub(r"[^A-Za-z0-9_.-]", "_", f"gpu-{gpu}"))
        if lock is None:
            continue
        held[gpu] = lock
        if len(held) == n:
            return held
    for lock in held.values():  # two half-served jobs must not wait on each other
        lock.close()
    return None


def claim_gpus(n: int, visible: list[str], scope: Path) -> dict[str, BinaryIO]:
    """Lock `n` of `visible` under `scope`, waiting while other jobs hold them; GPU -> open lock file."""
    waited = False
    while (held := try_claim_gpus(n, visible, scope)) is None:
        if not waited:
            logger.info("waiting for %d free GPUs of %s (other jobs hold them; locks in %s)", n, visible, scope)
            waited = True
        time.sleep(POLL_S)
    return held
