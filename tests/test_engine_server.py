"""An engine server serves one job at a time: the job's batches run one generate() each, their replies
name the files asked for, and the next job takes the engine, loaded, once the last one hands it back;
nothing stops it while a job's last files may still be landing.
A real engine server (vLLM on CPU, the demo model), driven by two jobs' ends of engine_pool."""

from __future__ import annotations

import time
from pathlib import Path

from eagle3data.engine import start as engine_mod
from eagle3data.engine import pool as engine_pool
from eagle3data.contracts.layers import eagle3_captures, parse_captures
from eagle3data.model.info import read_model_info
from eagle3data.engine.start import EngineSettings
from eagle3data.storage.store import sample_path
from eagle3bench.synthetic import random_prompts


def batches(store: Path, sizes: list[int], seed: int) -> list[tuple[list[list[int]], list[str]]]:
    """Prompts of 96 tokens and the states paths asked for them, batch by batch."""
    prompts = list(random_prompts(sum(sizes), 96, 900, seed=seed).items())
    out, start = [], 0
    for size in sizes:
        part = prompts[start : start + size]
        out.append(([ids for _, ids in part], [str(sample_path(store, sample_id)) for sample_id, _ in part]))
        start += size
    return out


def generated(engine: engine_pool.RemoteEngine, batch: tuple[list, list[str]]) -> None:
    """One batch's replies: one per prompt, naming the file asked for it, which lands (the connector
    writes a request's file in a step after the one that finished it)."""
    replies, _ = engine.generate(*batch)
    assert [reply["hidden_states_path"] for reply in replies] == batch[1]
    deadline = time.monotonic() + 60
    while not all(Path(path).exists() for path in batch[1]):
        assert time.monotonic() < deadline, [path for path in batch[1] if not Path(path).exists()]
        time.sleep(0.05)


def test_the_next_job_takes_the_engine_loaded_once_the_last_one_hands_it_back(tiny_deepseek, tmp_path):
    layers = read_model_info(tiny_deepseek).num_hidden_layers
    captures = parse_captures(eagle3_captures(layers), layers)
    engine = EngineSettings.with_defaults({"device": "cpu", "keep_alive_s": 60})
    store = tmp_path / "store"
    kwargs = engine_mod.engine_kwargs(str(tiny_deepseek), captures, "bfloat16", 512, engine, False, str(store))
    key = engine_pool.engine_key(kwargs, engine.cpu_kv_cache_gib)
    spec = {"kwargs": kwargs, "cpu_kv_cache_gib": engine.cpu_kv_cache_gib,
            "captures": [c.__dict__ for c in captures], "keep_alive_s": 60}
    first = engine_pool.start_server(key, spec, None, str(tmp_path), "job-a")
    try:
        a1, a2, b1 = batches(store, [4, 3, 5], seed=11)
        assert first.loaded_here and first.begin_shard("shard-a") == 1
        generated(first, a1)
        assert engine_pool.take_free(key) is None  # held by the first job
        generated(first, a2)
        first.hand_back()  # its last reply is in; its last files may still be landing
        second = engine_pool.take_free(key)
        assert second is not None and not second.loaded_here
        assert second.begin_shard("shard-b") == 2
        generated(second, b1)
        second.close()
        # Not idle while the first job's files may still land: nothing stops it, not even its own run.
        assert engine_pool.stop_idle_of_run(str(tmp_path)) == 0 and Path(first.entry.path).exists()
        first.close()
        assert engine_pool.stop_idle(lambda e: e.key == key) == 1 and not Path(first.entry.path).exists()
    finally:
        engine_pool.stop_idle(lambda e: e.key == key)
