"""The extract stage's timed steps: files read while generate() runs, and the stats that say where the
time went (generate, waiting for files, checking them, making the shard durable)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from corruption import RUN
from safetensors.torch import save_file

from eagle3data.extract import FileWatcher
from eagle3data.store import atomic_path, sample_path
from eagle3data.synthetic import random_prompts


class Row:
    def __init__(self, sample_id: str, input_ids: list[int]):
        self.sample_id, self.input_ids = sample_id, input_ids


def write_states(path: Path, ids: list[int]) -> None:
    with atomic_path(path, durable=False) as tmp:
        save_file({"hidden_states": torch.zeros(len(ids), 4, 8, dtype=torch.bfloat16),
                   "token_ids": torch.tensor(ids)}, tmp)


def test_the_watcher_reads_each_file_once_it_is_renamed_into_place(tmp_path):
    rows = [Row(sid, ids) for sid, ids in random_prompts(6, 5, 100).items()]
    paths = [sample_path(tmp_path, r.sample_id) for r in rows]
    write_states(paths[0], rows[0].input_ids)  # landed before generate() began

    def worker() -> None:  # what vLLM's writer threads do while generate() runs
        for row, path in list(zip(rows, paths))[1:4]:
            time.sleep(0.05)
            write_states(path, row.input_ids)

    with FileWatcher(rows, paths) as facts:
        writer = threading.Thread(target=worker)
        writer.start()
        writer.join()
        time.sleep(0.1)
    write_states(paths[4], rows[4].input_ids)  # landed after generate() returned: left to the caller
    assert sorted(facts) == sorted(r.sample_id for r in rows[:4])
    for row in rows[:4]:
        assert facts[row.sample_id]["token_ids"] == row.input_ids
        assert facts[row.sample_id]["shape"] == [5, 4, 8]


@pytest.mark.slow
def test_extract_stats_say_where_the_time_went(demo_run):
    for path in sorted((demo_run / RUN / "extract").glob("*.stats.json")):
        stats = json.loads(path.read_text())
        steps = {k: v for k, v in stats.items() if k.endswith("_seconds")}
        assert set(steps) == {"generate_seconds", "files_seconds", "checks_seconds", "durable_seconds"}, stats
        assert all(v >= 0 for v in steps.values())
        assert stats["seconds"] == pytest.approx(sum(steps.values()))
        assert steps["generate_seconds"] > 0 and stats["computed"] > 0, stats
