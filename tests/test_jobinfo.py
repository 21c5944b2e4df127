"""Each job claims GPUs of its own on a local run (SLURM jobs that see exactly theirs need not), and
extract jobs beyond the node's GPUs queue for its engine.

Real processes, as Snakemake starts jobs: each calls `start_job` and reports the CUDA_VISIBLE_DEVICES it
ended with. GPU names are fresh UUID-style ids, so the lock files never meet those of real jobs.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import uuid

import pytest
from conftest import demo_config, run_snakemake

from eagle3data.engine import jobinfo

JOB = """
import os, sys
from eagle3data.engine.jobinfo import start_job
start_job(int(sys.argv[1]))
print(os.environ["CUDA_VISIBLE_DEVICES"], flush=True)
sys.stdin.read()  # hold the GPUs until the test closes stdin
"""


def start(n: int, visible: list[str]) -> subprocess.Popen:
    """A local job asking for `n` GPUs of `visible`; prints the GPUs it got and holds them."""
    env = {k: v for k, v in os.environ.items() if k != "SLURM_JOB_ID"}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
    return subprocess.Popen([sys.executable, "-c", JOB, str(n)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def claimed(job: subprocess.Popen) -> list[str]:
    """The GPUs a job got (blocks until it has them)."""
    line = job.stdout.readline()
    assert line, job.stderr.read()
    return line.strip().split(",")


def release(job: subprocess.Popen) -> str:
    """End a job (its GPUs are free again); its log."""
    _, log = job.communicate("", timeout=60)
    assert job.returncode == 0, log
    return log


@pytest.fixture
def gpus():
    """Three fresh GPU names (no lock is shared with real jobs); their lock files go afterwards."""
    names = [f"GPU-{uuid.uuid4()}" for _ in range(3)]
    yield names
    for name in names:
        (jobinfo.LOCK_ROOT / f"{socket.gethostname()}-local" / f"gpu-{name}").unlink(missing_ok=True)


def test_side_by_side_jobs_get_different_gpus_and_wait_for_busy_ones(gpus):
    first, second = start(1, gpus), start(2, gpus)
    a, b = claimed(first), claimed(second)
    assert len(a) == 1 and len(b) == 2 and set(a) | set(b) == set(gpus)
    third = start(2, gpus)  # all 3 are held: it waits
    assert "waiting for 2 free GPUs" in third.stderr.readline()
    release(first)  # one GPU free: not enough, and it must not hold one while it waits
    assert select.select([third.stdout], [], [], 2)[0] == []
    release(second)
    c = claimed(third)
    assert len(c) == 2 and set(c) <= set(gpus)
    assert f"2 GPUs requested, CUDA_VISIBLE_DEVICES={','.join(c)}" in release(third)


def test_a_job_seeing_exactly_its_gpus_takes_them_without_locks(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    jobinfo.start_job(2)  # a plain SLURM job: SLURM bound exactly these two to it
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert not list(jobinfo.LOCK_ROOT.glob("*-4242"))


def test_exactly_the_visible_gpus_are_taken_as_they_are(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(jobinfo, "claim_gpus", None)  # a plain SLURM job: nothing to claim
    jobinfo.start_job(2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_clear_errors(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(jobinfo.GpuClaimError, match="asks for 4 GPUs, only 2 are visible"):
        jobinfo.start_job(4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(jobinfo.GpuClaimError, match="SLURM job 4242 asked for GPUs but has no CUDA_VISIBLE"):
        jobinfo.start_job(1)
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setattr(jobinfo, "NVIDIA_GPUS", jobinfo.Path("/nonexistent"))
    with pytest.raises(jobinfo.GpuClaimError, match="lists none and CUDA_VISIBLE_DEVICES is unset"):
        jobinfo.start_job(1)


@pytest.mark.slow
def test_extract_jobs_beyond_the_gpus_queue_for_the_engine_on_them(tmp_path, tiny_deepseek, gpus, monkeypatch):
    """Snakemake without `--resources gpu=1` runs the demo's three extract jobs side by side, each asking
    for the one GPU there is (`engine.cpu_job_gpus: 1`: the CPU engine computes without it, but claims it
    as a GPU engine would). The first job starts the engine on it; the others wait for that engine
    instead of starting engines of their own on a GPU in use, and it serves each in turn."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus[0])
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    config = demo_config(engine={"cpu_job_gpus": 1}, model={"path": str(tiny_deepseek), "build_demo": False})
    extracted = [f"results/demo/extract/shard-{i:05d}.parquet" for i in range(3)]
    run_snakemake(tmp_path, "--cores", "6", *extracted, config=config)  # extract's 2 threads: 3 jobs at once
    logs = [p.read_text() for p in sorted((tmp_path / "results/demo/logs/extract").glob("*.log"))]
    assert sum(log.count("starting engine ") for log in logs) == 1, [log[-1500:] for log in logs]
    assert sum("waiting for a free engine of these settings or 1 free GPUs" in log for log in logs) >= 1
    every = [json.loads(p.read_text()) for p in sorted((tmp_path / "results/demo/extract").glob("*.stats.json"))]
    assert len({s["engine_id"] for s in every}) == 1
    assert sorted(s["engine_shards_served"] for s in every) == [1, 2, 3]
