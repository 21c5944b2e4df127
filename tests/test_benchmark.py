"""The benchmark command in its smallest mode: one line per figure, last, and the same figures as JSON.

Timings are never asserted (this machine is shared and noisy); only that every figure asked for was
measured. Left to the benchmark command itself (the full test set has a time budget): figures 6, 6f, 6e
and 12 (two real runs, ~3 minutes), 9 (two engine starts, meaningless on a CPU), 2, 3 and 3m (validate
and pack over Kimi-shaped files, ~40 s) and 13 (writing and reading Kimi-K2.5's 2.3 GB output head,
~35 s). What they measure is tested on its own: compression, the readers, validate, pack and the parity
gate (tests/test_compression.py, tests/test_real_model.py, tests/test_validation.py, tests/test_parity.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from eagle3bench.figures import NAMES

pytestmark = pytest.mark.slow
ASKED = {f: name for f, name in NAMES.items() if f not in ("6", "6f", "6e", "12", "12v", "9", "2", "3", "3m", "13")}


def test_quick_benchmark_prints_and_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    work = os.path.relpath(tmp_path / "work", REPO)  # relative, as the default is: the Snakemake runs chdir
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3bench", "--quick", "--figures", ",".join(ASKED), "--work", work,
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = proc.stdout.strip().splitlines()[-len(ASKED):]
    assert [line.split()[:3] for line in lines] == [["figure", f, name] for f, name in ASKED.items()]
    for line in lines:
        assert line.split()[3] != "-" and ("PASS" in line or "FAIL" in line or "goal none" in line)
    report = json.loads(out.read_text())
    assert [(f["figure"], f["name"]) for f in report["figures"]] == list(ASKED.items())
    assert all(isinstance(f["value"], float) for f in report["figures"]) and not report["errors"]
    assert set(report["measurements"]) == {"planning", "tokenize", "extract", "end_to_end"}
    # Figure 7's run has several shards and one engine load: the node's engine serves them all.
    end_to_end = report["measurements"]["end_to_end"]
    assert end_to_end["shards"] > 1 and end_to_end["engine_loads"] == 1, end_to_end
    # Its engine served the shards one after another, each turn recorded in the order it came.
    turns = end_to_end["engine_turns"]
    assert [t["served"] for t in turns] == list(range(1, end_to_end["shards"] + 1)), turns
    assert all(t["tokens"] > 0 and t["generate_seconds"] > 0 for t in turns), turns
    # Its timeline follows the chain (each stage's last job after the one before), within the figure's span.
    t = end_to_end["timeline"]
    assert 0 < t["engine_held_seconds"] <= t["last_generate_end"] <= t["last_extract_end"], t
    assert t["last_extract_end"] <= t["last_validate_end"] <= t["last_pack_shard_end"] <= t["index_end"], t
    assert t["index_end"] == pytest.approx(end_to_end["seconds_from_engine_ready"]), t
    # Figures 10 and 11 count each byte of the run once (the dataset's files are the packed shards'); the
    # peak is at least what is left, and at least the pipeline's own peak, before the exports.
    disk = end_to_end["footprint"]
    assert disk["peak_bytes"] >= disk["run_bytes"] >= disk["dataset_bytes"] + disk["store_bytes"] > 0, disk
    assert disk["peak_bytes"] >= disk["pipeline_peak_bytes"] >= disk["dataset_bytes"], disk
    values = {f["figure"]: f["value"] for f in report["figures"]}
    assert values["10"] == disk["peak_bytes"] / disk["dataset_bytes"]
    assert values["11"] == disk["run_bytes"] / disk["dataset_bytes"]
