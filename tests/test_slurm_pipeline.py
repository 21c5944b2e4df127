"""The demo pipeline through `snakemake --profile profiles/slurm` on a real local SLURM (.ci/slurm.sh).

One module fixture runs the workflow twice on the same directory. The first run's extract jobs ask for
all 8 GPUs of the node (`engine.cpu_job_gpus`: the CPU engine uses none, SLURM still binds them), so
SLURM runs them one after the other. Shard 00000's job stops (test fault `pause`, utils/faults.py)
once every states file and its manifest are written, just before its stats file, and the test
`scancel`s it there (`--retries 0`: no resubmission in that run): a cancel at a known point, not a race
with the job. The second run must redo that job alone, from the store. The tests then check what both
runs left behind; the dataset must equal the local run's under the reproducibility contract.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, demo_config, run_snakemake
from snakemake.profiles import ProfileConfigFileParser

from eagle3data import open_dataset
from eagle3data.validate.reproducibility import dataset_differences
from eagle3data.utils import faults

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works with any pytest import mode
from slurm_cluster import local_slurm, skip_allowed, unavailable_reason, wait_job  # noqa: E402

RUN = "results/demo"
GPUS = 8
CANCELLED_SHARD = "00000"
PAUSE_POINT = f"write:*/extract/shard-{CANCELLED_SHARD}.stats.json"
PROFILE = [
    "--profile", str(REPO / "profiles" / "slurm"),
    # poll fast: the plugin waits 40 s before its first status check by default
    "--seconds-between-status-checks", "1", "--slurm-init-seconds-before-status-checks", "1",
]
SHARDS_PER_JOB = "EAGLE3_SLURM_SHARDS_PER_JOB"
SITE_ENV = ("EAGLE3_SLURM_ACCOUNT", "EAGLE3_SLURM_EXTRACT_MEM_MB", "EAGLE3_SLURM_GPU_PARTITION",
            "EAGLE3_SLURM_GPU_MODEL", "EAGLE3_SLURM_GPU_CONSTRAINT")
SUBMITTED = re.compile(r"Job (\d+) has been submitted with SLURM jobid (\d+) \(log: .*/rule_(\w+)/(?:(\d+)/)?\d+\.log\)")
FINISHED = re.compile(r"Finished jobid: (\d+) \(Rule: (\w+)\)")
JOB_LINE = re.compile(r"job on node (\S+), SLURM job (\S+), (\d+) GPUs requested, CUDA_VISIBLE_DEVICES=(\S+)")


@dataclass
class Submission:
    job: str  # snakemake's job id within its run
    slurm_id: str
    rule: str
    shard: str | None


@dataclass
class SlurmRuns:
    workdir: Path
    first: str  # snakemake's output
    second: str
    killed_shard: str
    killed_slurm_id: str
    killed_state: str
    stats_after_first: dict  # shard -> (stats json text, mtime) of the extract jobs that finished


def submissions(log: str) -> list[Submission]:
    return [Submission(*m.groups()) for m in SUBMITTED.finditer(log)]


def scancel_paused_extract(workdir: Path, run: threading.Thread) -> tuple[str, str]:
    """Wait until shard CANCELLED_SHARD's extract job pauses at PAUSE_POINT, then scancel it."""
    log_file = workdir / RUN / "logs" / "extract" / f"shard-{CANCELLED_SHARD}.log"
    end = time.monotonic() + 1200
    while run.is_alive() and time.monotonic() < end:
        log = log_file.read_text() if log_file.exists() else ""
        if faults.PAUSED in log:
            slurm_id = JOB_LINE.findall(log)[-1][1]
            subprocess.run(["scancel", slurm_id], check=True)
            return CANCELLED_SHARD, slurm_id
        time.sleep(0.2)
    raise AssertionError(f"the extract job of shard {CANCELLED_SHARD} never paused at {PAUSE_POINT}")


@contextlib.contextmanager
def site_settings(**env: str | None):
    """The profile's site settings for the local cluster (partition main; no account: no slurmdbd; no GPU
    types), and `env` (None: unset), as long as the block lasts; yields the MonkeyPatch for more."""
    with pytest.MonkeyPatch.context() as patch:
        for name in SITE_ENV:
            patch.delenv(name, raising=False)
        patch.setenv("EAGLE3_SLURM_PARTITION", "main")
        for name, value in env.items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        yield patch


@pytest.fixture(scope="module")
def slurm_runs(tmp_path_factory) -> SlurmRuns:
    reason = unavailable_reason()
    if reason and skip_allowed():
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("slurm-run")
    # A SLURM job per shard: the cancel hits one shard.
    with site_settings(**{SHARDS_PER_JOB: "1"}) as patch, local_slurm(tmp_path_factory.mktemp("cluster")):
        result: dict = {}
        patch.setenv(faults.ENV, f"pause@{PAUSE_POINT}")  # the first run only
        run = threading.Thread(target=lambda: result.update(proc=run_snakemake(
            workdir, *PROFILE, "--retries", "0", config=demo_config(engine={"cpu_job_gpus": GPUS}),
            check=False)))
        run.start()
        shard, slurm_id = scancel_paused_extract(workdir, run)
        state = wait_job(slurm_id)
        run.join()
        patch.delenv(faults.ENV)
        first = result["proc"].stdout + result["proc"].stderr
        assert result["proc"].returncode != 0, f"the run with a cancelled job succeeded:\n{first[-4000:]}"
        stats = {p.name.split(".")[0].removeprefix("shard-"): (p.read_text(), p.stat().st_mtime_ns)
                 for p in (workdir / RUN / "extract").glob("shard-*.stats.json")}
        second = run_snakemake(workdir, *PROFILE)
        return SlurmRuns(workdir, first, second.stdout + second.stderr, shard, slurm_id, state, stats)


@pytest.fixture(scope="module")
def grouped_run(tmp_path_factory, tiny_deepseek) -> tuple[Path, str]:
    """The demo's extraction through the profile as it is by default: its three extract jobs (shards) in
    one SLURM job. Only as far as extract: the other fixture checks what the rest of the chain makes."""
    reason = unavailable_reason()
    if reason and skip_allowed():
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("slurm-grouped")
    with site_settings(**{SHARDS_PER_JOB: None}), local_slurm(tmp_path_factory.mktemp("cluster")):
        extracted = [f"{RUN}/extract/shard-{i:05d}.parquet" for i in range(3)]
        config = demo_config(engine={"cpu_job_gpus": GPUS}, model={"path": str(tiny_deepseek), "build_demo": False})
        proc = run_snakemake(workdir, *PROFILE, *extracted, config=config)
    return workdir, proc.stdout + proc.stderr


def test_one_engine_per_allocation_by_default(grouped_run):
    """By default an allocation runs several extract jobs, and one engine, loaded once, serves them all."""
    workdir, log = grouped_run
    every = [json.loads(p.read_text()) for p in sorted((workdir / RUN / "extract").glob("*.stats.json"))]
    jobs = {JOB_LINE.findall(p.read_text())[-1][1] for p in (workdir / RUN / "logs" / "extract").glob("*.log")}
    assert len(every) == 3 and len(jobs) == 1, log[-4000:]
    assert len({s["engine_id"] for s in every}) == 1 and sum(s["engine_loaded_here"] for s in every) == 1
    assert sorted(s["engine_shards_served"] for s in every) == [1, 2, 3]


@pytest.mark.slow
def test_one_engine_per_allocation_with_a_shard_per_job(slurm_runs):
    per_shard = [json.loads(text) for text, _ in slurm_runs.stats_after_first.values()]
    assert per_shard and all(s["engine_loaded_here"] for s in per_shard)
    assert len({s["engine_id"] for s in per_shard}) == len(per_shard)


@pytest.mark.slow
def test_every_job_went_through_sbatch(slurm_runs):
    for log in (slurm_runs.first, slurm_runs.second):
        submitted = {s.job: s.slurm_id for s in submissions(log)}
        finished = FINISHED.findall(log)
        assert finished, log[-4000:]
        for job, rule in finished:
            if rule != "all":  # the target rule has no action: nothing to submit
                assert job in submitted, f"{rule} job {job} finished without an sbatch submission"
        assert len(set(submitted.values())) == len(submitted)
    first_ids = {s.slurm_id for s in submissions(slurm_runs.first)}
    assert not first_ids & {s.slurm_id for s in submissions(slurm_runs.second)}


@pytest.mark.slow
def test_extract_jobs_of_all_shards_are_queued_at_once(slurm_runs):
    """Extraction scales out: `gpu` is a per-node resource (rules/common.smk), so the local profile's
    --resources gpu=8 does not hold back submissions of 8-GPU jobs; SLURM queues them."""
    log = slurm_runs.first
    first_extract_done = min(m.start() for m in FINISHED.finditer(log) if m.group(2) == "extract")
    queued = [m for m in SUBMITTED.finditer(log) if m.group(3) == "extract" and m.start() < first_extract_done]
    assert len(queued) == 3, log[-4000:]


@pytest.mark.slow
def test_each_extract_job_received_its_gpus(slurm_runs):
    extract_ids = {s.slurm_id for log in (slurm_runs.first, slurm_runs.second)
                   for s in submissions(log) if s.rule == "extract"}
    logs = sorted((slurm_runs.workdir / RUN / "logs" / "extract").glob("shard-*.log"))
    assert len(logs) == 3
    for path in logs:
        node, slurm_id, requested, gpus = JOB_LINE.findall(path.read_text())[-1]
        assert slurm_id in extract_ids and int(requested) == GPUS
        assert sorted(gpus.split(",")) == sorted(str(i) for i in range(GPUS)), path


@pytest.mark.slow
def test_cancelled_job_reruns_from_the_store(slurm_runs):
    assert slurm_runs.killed_state == "CANCELLED"
    shard = slurm_runs.killed_shard
    assert shard not in slurm_runs.stats_after_first  # its outputs were removed with the failed job
    redone = [(s.rule, s.shard) for s in submissions(slurm_runs.second)]
    assert ("extract", shard) in redone and ("validate", shard) in redone
    assert not [r for r in redone if r[0] in ("demo_model", "tokenize") or r[0] == "extract" and r[1] != shard]
    extract = slurm_runs.workdir / RUN / "extract"
    stats = json.loads((extract / f"shard-{shard}.stats.json").read_text())
    assert stats["computed"] == 0 and stats["reused"] == stats["samples"] > 0, stats
    for other, (text, mtime) in slurm_runs.stats_after_first.items():
        path = extract / f"shard-{other}.stats.json"
        assert (path.read_text(), path.stat().st_mtime_ns) == (text, mtime)
        counts = json.loads(text)
        assert counts["reused"] + counts["computed"] == counts["samples"]


@pytest.mark.slow
def test_dataset_equals_the_local_run(slurm_runs, demo_run):
    problems = dataset_differences(open_dataset(slurm_runs.workdir / RUN / "dataset"),
                                   open_dataset(demo_run / RUN / "dataset"))
    assert not problems, "\n".join(problems)


def test_site_settings_reach_only_gpu_jobs(monkeypatch):
    """The profile's environment variables become resources of every job, or of the jobs that start an
    engine (extract, regenerate) only."""
    env = {"EAGLE3_SLURM_PARTITION": "cpu", "EAGLE3_SLURM_ACCOUNT": "proj", "EAGLE3_SLURM_GPU_PARTITION": "gpu",
           "EAGLE3_SLURM_GPU_MODEL": "h100", "EAGLE3_SLURM_GPU_CONSTRAINT": "h100&ib",
           "EAGLE3_SLURM_EXTRACT_MEM_MB": "64000"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with open(REPO / "profiles" / "slurm" / "config.yaml") as f:
        profile = ProfileConfigFileParser().parse(f)
    assert {"slurm_partition='cpu'", "slurm_account='proj'"} <= set(profile["default-resources"])
    assert sorted(profile["set-resources"]) == sorted(
        f"{rule}:{setting}" for rule in ("extract", "regenerate") for setting in (
            "mem_mb=64000 * attempt", "slurm_partition='gpu'", "gpu_model='h100'", "constraint='h100&ib'"))
    for name in env:
        monkeypatch.delenv(name)
    with open(REPO / "profiles" / "slurm" / "config.yaml") as f:
        profile = ProfileConfigFileParser().parse(f)
    assert "set-resources" not in profile
    assert not [r for r in profile["default-resources"] if r.startswith(("slurm_partition", "slurm_account"))]
