"""The local SLURM of .ci/slurm.sh really schedules GPUs, and profiles/slurm drives it.

Proves the pieces the pipeline's SLURM path relies on: sbatch hands out the 8 fake GPUs, a
`snakemake --profile profiles/slurm` run goes through sbatch (no sacct, no account) and the rule sees
exactly its `gpu=2` GPUs, and `stop` leaves no daemon behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # works with any pytest import mode
from slurm_cluster import REPO, local_slurm, skip_allowed, unavailable_reason, wait_job  # noqa: E402

SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def skip_if_allowed() -> None:
    """Skip when SLURM is unavailable and EAGLE3_ALLOW_SKIP_SLURM=1; else local_slurm raises."""
    reason = unavailable_reason()
    if reason and skip_allowed():
        pytest.skip(reason)


@pytest.fixture
def slurm(tmp_path):
    """A running local SLURM for one test (SLURM_CONF set while it runs)."""
    skip_if_allowed()
    with local_slurm(tmp_path) as conf:
        yield conf


def test_sbatch_gets_eight_gpus(slurm, tmp_path):
    out = tmp_path / "job.out"
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--gpus=8", "-o", str(out), "--wrap", "echo $CUDA_VISIBLE_DEVICES $SLURM_JOB_ID"],
        capture_output=True, text=True, check=True).stdout.strip()
    assert wait_job(job_id) == "COMPLETED"
    gpus, seen_id = out.read_text().split()
    assert gpus.split(",") == [str(i) for i in range(8)]
    assert seen_id == job_id


@pytest.mark.slow
def test_snakemake_profile_submits_through_sbatch(slurm, tmp_path):
    wf = tmp_path / "wf"
    wf.mkdir()
    (wf / "Snakefile").write_text(
        'rule two_gpus:\n'
        '    output: "gpus.txt"\n'
        '    resources: gpu=2\n'
        '    shell: "echo $CUDA_VISIBLE_DEVICES $SLURM_JOB_ID > {output}"\n')
    env = {**os.environ, "EAGLE3_SLURM_PARTITION": "main"}
    env.pop("EAGLE3_SLURM_ACCOUNT", None)  # no slurmdbd here: an account would fail validation
    run = subprocess.run(
        [str(SNAKEMAKE), "--profile", str(REPO / "profiles" / "slurm"), "--jobs", "1",
         # poll fast: the plugin waits 40 s before its first status check by default
         "--seconds-between-status-checks", "1", "--slurm-init-seconds-before-status-checks", "1"],
        cwd=wf, env=env, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", log)
    assert len(submitted) == 1, log
    gpus, seen_id = (wf / "gpus.txt").read_text().split()
    assert len(gpus.split(",")) == 2, gpus
    assert seen_id == submitted[0]


def live(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_leaves_no_daemons(tmp_path):
    skip_if_allowed()
    with local_slurm(tmp_path) as conf:
        state = conf.parent
        pids = [int((state / f).read_text()) for f in ("slurmctld.pid", "slurmd.pid", "munge/munged.pid")]
        assert all(live(p) for p in pids)
        assert Path("/etc/slurm/slurm.conf").resolve() == conf
        subprocess.run(["sbatch", "-o", "/dev/null", "--wrap", "sleep 300"], check=True, capture_output=True)
    assert not any(live(p) for p in pids)
    assert not Path("/etc/slurm/slurm.conf").is_symlink()
    for name in ("slurmctld", "slurmd", "slurmstepd", "munged"):  # pgrep lists zombies too: filter them
        found = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout.split()
        assert not [p for p in found if live(int(p))], f"{name} still running: {found}"
