"""The engine is fed, not called: a job's batches queue in the engine behind each other, the next job
sends its first batch while the last one's batches still run, and each job gets its replies in its own
order. A real engine server (vLLM on CPU, the demo model), driven by two jobs' ends of engine_pool."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psutil
import yaml
from conftest import REPO

from eagle3data import engine as engine_mod
from eagle3data import engine_pool
from eagle3data.layers import parse_captures
from eagle3data.settings import engine_config
from eagle3data.store import sample_path
from eagle3data.bench.synthetic import random_prompts


def batches(store: Path, sizes: list[int], seed: int) -> list[tuple[list[list[int]], list[str]]]:
    """Prompts of 96 tokens and the states paths asked for them, batch by batch."""
    prompts = list(random_prompts(sum(sizes), 96, 900, seed=seed).items())
    out, start = [], 0
    for size in sizes:
        part = prompts[start : start + size]
        out.append(([ids for _, ids in part], [str(sample_path(store, sample_id)) for sample_id, _ in part]))
        start += size
    return out


def collected(engine: engine_pool.RemoteEngine, sent: tuple[list, list[str]]) -> None:
    """The oldest batch's replies: one per prompt, naming the file asked for it, which lands (the
    connector writes a request's file in a step after the one that finished it)."""
    replies = engine.collect()
    assert [reply["hidden_states_path"] for reply in replies] == sent[1]
    deadline = time.monotonic() + 60
    while not all(Path(path).exists() for path in sent[1]):
        assert time.monotonic() < deadline, [path for path in sent[1] if not Path(path).exists()]
        time.sleep(0.05)


def test_the_next_job_feeds_the_engine_while_the_last_ones_batches_run(tiny_deepseek, tmp_path):
    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    captures = parse_captures(config["captures"], config["model"]["num_hidden_layers"])
    engine = engine_config({"device": "cpu", "keep_alive_s": 60})
    store = tmp_path / "store"
    kwargs = engine_mod.engine_kwargs(str(tiny_deepseek), captures, "bfloat16", 512, engine, False, str(store))
    key = engine_pool.engine_key(kwargs, engine["cpu_kv_cache_gib"])
    spec = {"kwargs": kwargs, "cpu_kv_cache_gib": engine["cpu_kv_cache_gib"],
            "captures": [c.__dict__ for c in captures], "keep_alive_s": 60}
    first = engine_pool.start_server(key, spec, None, str(tmp_path), "job-a")
    try:
        a1, a2, b1, c1 = batches(store, [4, 48, 3, 5], seed=11)
        assert first.begin_shard("shard-a") == 1
        # vLLM's engine processes stopped: the server's loop waits in its step on a1, so a2 and b1 are
        # both waiting to go in when they resume, whatever the machine's load.
        engine_processes = psutil.Process(first.entry.pid).children(recursive=True)
        for process in engine_processes:
            process.suspend()
        first.submit(*a1)
        first.submit(*a2)
        first.release()  # its last batch is sent: the engine goes to the next job
        second = engine_pool.take_free(key)
        assert second is not None and not second.loaded_here
        assert second.begin_shard("shard-b") == 2
        second.submit(*b1)
        for process in engine_processes:
            process.resume()
        collected(second, b1)  # each job reads its own replies, whatever the other does
        collected(first, a1)
        collected(first, a2)
        first.close()
        second.close()
        log = Path(first.entry.log).read_text()
        waiting = dict(re.findall(r"a batch of \d+ samples of (shard-\w); (\d+) requests in the engine", log))
        assert int(waiting["shard-b"]) > 0, log[-3000:]  # shard-a's last batch was still running

        # A stop while a job's batches run (it has handed the engine on) lets them finish first.
        third = engine_pool.take_free(key)
        third.begin_shard("shard-c")
        third.submit(*c1)
        third.release()
        stopped = []
        stopper = threading.Thread(target=lambda: stopped.append(engine_pool.stop_idle(lambda e: e.key == key)))
        stopper.start()
        collected(third, c1)
        third.close()
        stopper.join(timeout=120)
        assert stopped == [1] and not Path(first.entry.path).exists()
    finally:
        engine_pool.stop_idle(lambda e: e.key == key)
