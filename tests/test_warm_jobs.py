"""The tail stages' jobs run in children of a warm server (eagle3data.warm_jobs) as they would in
their own process: the job's descriptors, directory and environment, its exit code or signal back to
Snakemake, the signals Snakemake sends forwarded, and nothing left running once the job's process is
killed. The pipeline tests run every validate, pack_shard and pack job this way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CLIENT = "import json, sys; from eagle3data.warm_jobs import run; run(sys.argv[1], json.loads(sys.argv[2]))"


@pytest.fixture
def warm(tmp_path):
    """A client command runner whose jobs share one server, killed at the end."""
    (tmp_path / "tmp").mkdir()
    (tmp_path / "work").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONPATH": str(TESTS),
           "EAGLE3DATA_WARM_IDLE_S": "120", "WARM_TEST_MARKER": "from the job's process"}
    env.pop("SLURM_JOB_ID", None)

    def job(target: str, argument=None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", CLIENT, f"warm_targets:{target}", json.dumps(argument)],
                                cwd=tmp_path / "work", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, **kwargs)

    job.root = tmp_path / "tmp" / f"eagle3data-warm-{os.getuid()}"
    yield job
    for log in job.root.glob("*.log"):
        for line in log.read_text().splitlines():
            if line.startswith("warm job server ") and "ready" in line:
                try:
                    os.kill(int(line.split()[3]), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def finished(process: subprocess.Popen, stdin: str = "") -> tuple[int, str, str]:
    out, err = process.communicate(stdin, timeout=120)
    return process.returncode, out, err


def wait_for(condition, what: str, seconds: float = 60):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.1)
    return value


def test_a_job_runs_in_a_warm_child_as_in_its_own_process(warm):
    process = warm("report", "first", stdin=subprocess.PIPE)
    code, out, err = finished(process, "input one")
    first = json.loads(out)
    assert code == 0 and first["pid"] == process.pid, err  # no server yet: ran in its own process
    wait_for(lambda: list(warm.root.glob("*.sock")), "the server it started")

    process = warm("report", {"shard": 7}, stdin=subprocess.PIPE)
    code, out, err = finished(process, "input two")
    second = json.loads(out)
    assert code == 0 and second["pid"] != process.pid and second["ppid"] != process.pid, err
    assert second["group"] == second["pid"]  # a process group of its own
    assert second["cwd"] == first["cwd"] and second["marker"] == "from the job's process"
    assert second["stdin"] == "input two" and second["job"] == {"shard": 7} and "on stderr" in err


def test_exit_codes_and_signals_reach_snakemake_and_a_killed_job_leaves_nothing_running(warm, tmp_path):
    finished(warm("exit_with", 0))
    wait_for(lambda: list(warm.root.glob("*.sock")), "the server")
    assert finished(warm("exit_with", 3))[0] == 3
    code, _, err = finished(warm("fail", "a named failure"))
    assert code == 1 and "ValueError: a named failure" in err
    code, _, err = finished(warm("exit_with", "a message for the log"))
    assert code == 1 and "a message for the log" in err
    assert finished(warm("kill_self", int(signal.SIGKILL)))[0] == -signal.SIGKILL

    for stop, code in ((lambda p: p.terminate(), -signal.SIGTERM), (lambda p: p.kill(), -signal.SIGKILL)):
        pid_file = tmp_path / f"child-{-code}"
        process = warm("sleep_until_killed", str(pid_file))
        child = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), "the job's child"))
        assert child != process.pid
        stop(process)  # SIGTERM: forwarded to the child; SIGKILL: the child is killed by its supervisor
        assert finished(process)[0] == code
        wait_for(lambda: not Path(f"/proc/{child}").exists(), f"child {child} to be gone", seconds=30)
