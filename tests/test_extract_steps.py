"""The extract stage's timed steps: files checked while generate() runs (the watcher), host
buffers reused by the connector, and the stats that say where the time went."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import torch
from corruption import RUN
from safetensors.torch import save_file

from eagle3data.capture.extract import TIMED_STEPS
from eagle3data.contracts.layers import parse_captures
from eagle3data.capture.pinned import PinnedBuffers
from eagle3data.contracts.states import Expected
from eagle3data.storage.store import atomic_path, sample_path
from eagle3bench.synthetic import random_prompts
from eagle3data.capture.watcher import StatesWatcher
from eagle3data.utils import faults

EXPECTED = Expected(parse_captures([{"layer": 1, "point": "input"}, {"layer": 2, "point": "input"},
                                    {"layer": 3, "point": "input"}, {"layer": 3, "point": "output"}], 4),
                    8, "bfloat16")


class Row:
    def __init__(self, sample_id: str, input_ids: list[int]):
        self.sample_id, self.input_ids = sample_id, input_ids


def write_states(path: Path, ids: list[int], hidden: int = 8) -> None:
    with atomic_path(path, durable=False) as tmp:
        save_file({"hidden_states": torch.zeros(len(ids), 4, hidden, dtype=torch.bfloat16),
                   "token_ids": torch.tensor(ids)}, tmp)


def batch(tmp_path, n: int, seed: int) -> tuple[list[Row], list[Path]]:
    rows = [Row(sid, ids) for sid, ids in random_prompts(n, 5, 100, seed=seed).items()]
    return rows, [sample_path(tmp_path, r.sample_id) for r in rows]


def test_the_watcher_checks_each_file_once_it_is_renamed_into_place(tmp_path, monkeypatch):
    rows, paths = batch(tmp_path, 6, seed=1)
    late_rows, late_paths = batch(tmp_path, 3, seed=2)
    monkeypatch.setenv(faults.ENV, f"fail@landed:{late_rows[2].sample_id}")
    write_states(paths[0], rows[0].input_ids)  # landed before generate() began
    with StatesWatcher(EXPECTED) as watcher:
        watcher.expect(rows, paths)

        def worker() -> None:  # what vLLM's writer threads do while generate() runs
            for row, path in list(zip(rows, paths))[1:4]:
                time.sleep(0.05)
                write_states(path, row.input_ids)

        writer = threading.Thread(target=worker)
        writer.start()
        writer.join()
        time.sleep(0.2)
        assert sorted(watcher.whole()) == sorted(paths[:4])  # checked while "generate()" ran
        watcher.expect(late_rows, late_paths)  # the next batch, handed over before the last one's files
        write_states(paths[4], rows[4].input_ids[::-1])  # not the tokens asked for
        write_states(late_paths[0], late_rows[0].input_ids, hidden=16)  # the wrong hidden size
        write_states(late_paths[1], late_rows[1].input_ids)
        write_states(late_paths[2], late_rows[2].input_ids)  # whole, but failed by the test fault
        watcher.drop(rows[5].sample_id)  # failed elsewhere: its file never comes
        problems = watcher.finish(timeout_s=5)
    assert sorted(problems) == sorted([rows[4].sample_id, late_rows[0].sample_id, late_rows[2].sample_id])
    assert "token_ids" in "\n".join(problems[rows[4].sample_id])
    assert "16" in "\n".join(problems[late_rows[0].sample_id])
    assert "failed on purpose" in problems[late_rows[2].sample_id][0]
    assert sorted(watcher.whole()) == sorted(paths[:4] + late_paths[1:2])


def test_one_gather_for_several_requests_gives_each_request_its_own_states():
    """Batching must not scramble per-request states: each request's view of the one gather (and its
    measures, from which the file's facts are written) equals what vLLM's extract_from_kv_cache gives for
    that request alone, on a cache of vLLM's own layout."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import extract_from_kv_cache

    from eagle3data.capture.connector import gather_requests, request_slots
    from eagle3data.contracts.measuring import measured

    block_size, blocks = 16, 40
    generator = torch.Generator().manual_seed(0)
    cache = torch.randn(blocks, 4, block_size, 8, generator=generator)  # [blocks, captures, block, H] (0.32)
    requests = [([7, 3], 20), ([0], 16), ([12, 30, 5], 33), ([39], 1)]  # (block ids, tokens)
    slots = [request_slots(ids, block_size, tokens) for ids, tokens in requests]
    assert list(slots[0][:3]) == [7 * 16, 7 * 16 + 1, 7 * 16 + 2] and slots[0][16] == 3 * 16
    parts, all_measures = gather_requests(cache, slots)
    assert [tuple(p.shape) for p in parts] == [(20, 4, 8), (16, 4, 8), (33, 4, 8), (1, 4, 8)]
    for part, measures, request_slot in zip(parts, torch.split(all_measures, [20, 16, 33, 1]), slots):
        alone = extract_from_kv_cache(cache, torch.from_numpy(request_slot), len(request_slot))
        assert torch.equal(part, alone)
        assert torch.equal(measures, measured(alone))  # the facts written with it are its own
    assert not torch.equal(parts[0][:16], parts[1])  # different requests, different states


def test_the_connector_gathers_a_step_s_requests_in_groups_of_bounded_size():
    from eagle3data.capture.connector import _groups

    class Pending:
        def __init__(self, n: int):
            self.token_ids = torch.zeros(n)

    pendings = [Pending(n) for n in (3000, 1000, 100, 5000, 10, 4096)]
    sizes = [[len(p.token_ids) for p in group] for group in _groups(pendings, 4096)]
    assert sizes == [[3000, 1000], [100], [5000], [10], [4096]]
    assert _groups([], 4096) == []


def test_copies_on_gpu_wait_for_the_step_s_start_and_a_step_without_one_stops_the_engine():
    """The GPU copies wait for an event recorded in start_load_kv. A step whose start_load_kv did not run
    (a vLLM that skips it) must stop the engine, not copy after a stale event from an earlier step."""
    from eagle3data.capture.connector import Eagle3StatesConnector

    connector = Eagle3StatesConnector.__new__(Eagle3StatesConnector)  # no engine: only the GPU path's guard
    connector._buffers = object()  # as on GPU, rank 0
    connector._step_began = marker = object()
    assert connector._take_step_began() is marker
    with pytest.raises(RuntimeError, match="start_load_kv"):
        connector.get_finished(set())  # the event was taken once: the next step needs its own


def test_a_file_that_never_comes_is_a_failed_sample_named_with_its_path(tmp_path):
    rows, paths = batch(tmp_path, 2, seed=3)
    write_states(paths[0], rows[0].input_ids)
    with StatesWatcher(EXPECTED) as watcher:
        watcher.expect(rows, paths)
        problems = watcher.finish(timeout_s=0.3)
    assert list(problems) == [rows[1].sample_id]
    assert f"did not write {paths[1]} within 0 s" in problems[rows[1].sample_id][0]


def test_host_buffers_are_reused_and_the_engine_waits_when_all_are_in_use():
    buffers = PinnedBuffers(2, max_tokens=8, per_token=(4, 3), dtype=torch.bfloat16, pin=False)
    first, view = buffers.take(5)
    assert view.shape == (5, 4, 3) and view.is_contiguous() and view.data_ptr() == first.data_ptr()
    second, _ = buffers.take(8)
    threading.Timer(0.2, buffers.give_back, [first]).start()  # a writer finishing its file
    again, _ = buffers.take(1)
    assert again is first and buffers.waited_seconds >= 0.1
    with pytest.raises(ValueError, match="9 tokens does not fit buffers of 8 tokens"):
        buffers.take(9)


def test_extract_stats_say_where_the_time_went(demo_run):
    paths = sorted((demo_run / RUN / "extract").glob("*.stats.json"))
    assert len(paths) == 3
    every = []
    for path in paths:
        stats = json.loads(path.read_text())
        steps = {f"{step}_seconds": stats[f"{step}_seconds"] for step in TIMED_STEPS}
        assert all(v >= 0 for v in steps.values())
        assert stats["seconds"] == pytest.approx(sum(steps.values()))  # the engine's start kept out
        assert steps["generate_seconds"] > 0 and stats["computed"] > 0, stats
        assert 0 <= stats["files_to_come_after_generate"] <= stats["computed"], stats
        every.append(stats)
    # One engine served the run's three shards: the job that loaded it waited for its load; the others
    # found it loaded, and it counted the shards it served.
    assert len({s["engine_id"] for s in every}) == 1
    loaded = [s for s in every if s["engine_loaded_here"]]
    assert len(loaded) == 1 and loaded[0]["engine_start_seconds"] >= loaded[0]["engine_load_seconds"] > 0
    assert sorted(s["engine_shards_served"] for s in every) == [1, 2, 3]
    assert loaded[0]["engine_shards_served"] == 1
    logs = [p.read_text() for p in sorted((demo_run / RUN / "logs" / "extract").glob("*.log"))]
    assert sum(log.count("starting engine ") for log in logs) == 1  # the engine starts once, by the logs
    for stats in every:
        assert stats["engine_load_seconds"] == loaded[0]["engine_load_seconds"]
        if not stats["engine_loaded_here"]:
            assert stats["engine_start_seconds"] < stats["engine_load_seconds"], stats
    # The report sums the same per node: one node, three shards, one load of that many seconds.
    summary = (demo_run / RUN / "report" / "summary.html").read_text()
    engines = summary[summary.index("Engines per node"):summary.index("Extraction per shard")]
    cells = re.findall(r"<td>([^<]*)</td>", engines)
    assert cells[:4] == [loaded[0]["engine_node"], "3", "1", f"{loaded[0]['engine_load_seconds']:.1f}"], cells
