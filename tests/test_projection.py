"""The node projection (`eagle3bench.projection`): its numbers follow from its stated inputs, and
the terms that should lower the GPU-busy share do, naming themselves as the bound. No engine; seconds."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

from eagle3bench.projection import main

H200_RUN = REPO / "docs/measurements/2026-12-01-h200-figure1-default.json"


def projection(capsys, *args: str) -> dict:
    main([*args, "--json"])
    return json.loads(capsys.readouterr().out)


def test_kimi_defaults_give_what_the_formulas_imply(capsys):
    measured = json.loads(H200_RUN.read_text())
    # Kimi-K2.5 on 8 H200s: 300,000 conversations of 400 tokens in shards of 1,000, 4 x [T, 7168] bf16.
    tokens = 300_000 * 400
    states = tokens * 57_344
    shards = 300
    prefill = measured["bare"]["tokens_per_second"] * 8.03e9 / 32e9 * 8
    extract_rate = prefill * measured["figures"]["extract_over_bare"]
    disk = measured["write"]["store_bytes_per_second"]
    busy = tokens / prefill
    # One engine start; the first shard's tokenize ahead of it; extraction sharing the disk with pack
    # (read + write) of all shards but the last (validate reads the facts in the headers only); the
    # last shard's pack after it (the dataset is then an index).
    behind = states * (shards - 1) / shards
    extraction = max(tokens / extract_rate, (states + 2 * behind) / disk)
    pack = max(states / 0.95e9, 2 * states / disk)
    # Between two of the 300 extract jobs the one engine's GPUs idle 0.5 s.
    wall = tokens / shards / 25_600 + 22 * 60 + shards * 0.5 + extraction + pack / shards

    result = projection(capsys)
    assert result["tokens"] == tokens and result["shards"] == shards and result["engine_starts"] == 1
    assert result["state_bytes"] == pytest.approx(6.88e12, rel=1e-3)
    assert result["gpu_busy_seconds"] == pytest.approx(busy, rel=1e-4)
    assert result["wall_seconds"] == pytest.approx(wall, rel=1e-3)
    assert result["gpu_busy_share"] == pytest.approx(busy / wall, rel=1e-3)
    stages = {s["stage"]: s for s in result["stages"]}
    assert stages["pack"]["disk_bytes"] == pytest.approx(2 * states)
    assert stages["validate"]["critical_seconds"] == 0 and stages["validate"]["disk_bytes"] == 0
    losses = sum(loss["seconds"] for loss in result["losses"])
    assert losses == pytest.approx(result["wall_seconds"] - result["gpu_busy_seconds"], rel=1e-9)
    assert stages["pack"]["critical_seconds"] == pytest.approx(pack / shards, rel=1e-3)
    assert result["bound"].startswith("disk during extraction") and result["gpu_busy_share"] < result["goal"]
    # The pipeline before one engine served many shards: one engine start per shard.
    assert result["compared"]["engine_starts"] == shards
    assert result["compared"]["wall_seconds"] == pytest.approx(wall + (shards - 1) * 22 * 60, rel=1e-3)
    # validation.read_states: validate reads every byte beside extraction, and the last shard's after it.
    reading = projection(capsys, "--validate-reads-states")
    extraction = max(tokens / extract_rate, (states + 3 * behind) / disk)
    last_validate = states / shards / min(1.70e9, disk)
    assert reading["wall_seconds"] == pytest.approx(
        tokens / shards / 25_600 + 22 * 60 + shards * 0.5 + extraction + last_validate + pack / shards, rel=1e-3)
    # storage.transport_dir: the files on a RAM disk; the disk takes pack's writes alone, once a byte.
    ram = projection(capsys, "--transport")
    extraction = max(tokens / extract_rate, behind / disk)
    pack = max(states / 0.95e9, states / disk)
    assert ram["wall_seconds"] == pytest.approx(
        tokens / shards / 25_600 + 22 * 60 + shards * 0.5 + extraction + pack / shards, rel=1e-3)
    assert {s["stage"]: s["disk_bytes"] for s in ram["stages"]}["pack"] == pytest.approx(states)
    assert ram["gpu_busy_share"] > result["gpu_busy_share"]


def test_measured_file_gives_the_built_in_rates(capsys):
    assert projection(capsys, "--measured", str(H200_RUN))["gpu_busy_share"] == pytest.approx(
        projection(capsys)["gpu_busy_share"], rel=1e-3)
    benchmark_command = REPO / "docs/measurements/2026-11-30-h200-figures-1-7.json"
    measured = projection(capsys, "--measured", str(benchmark_command))
    assert measured["inputs"]["prefill_tps"] == pytest.approx(42_719.2 * 8.03e9 / 32e9 * 8, rel=1e-4)
    assert measured["inputs"]["extract_over_bare"] == pytest.approx(0.964, abs=1e-3)


def test_slower_disk_lowers_the_share_and_the_bound_names_it(capsys):
    fast = projection(capsys, "--disk-gbps", "100")
    default = projection(capsys)
    slow = projection(capsys, "--disk-gbps", "0.5")
    assert fast["gpu_busy_share"] > default["gpu_busy_share"] > slow["gpu_busy_share"]
    # With the disk out of the way, the engine's start; 300 extract jobs one at a time (10 s each: 3,000 s)
    # would outweigh it.
    assert "disk" not in fast["bound"] and fast["bound"].startswith("engine starts")
    one_at_a_time = projection(capsys, "--disk-gbps", "100", "--job-overhead-s", "10")
    assert one_at_a_time["bound"].startswith("extract jobs' own start and end")
    assert one_at_a_time["gpu_busy_share"] < fast["gpu_busy_share"]
    assert "disk" in slow["bound"]


def test_more_engine_starts_lower_the_share(capsys):
    shares = [projection(capsys, "--engine-starts", n)["gpu_busy_share"] for n in ("1", "3", "per-shard")]
    assert shares == sorted(shares, reverse=True) and len(set(shares)) == 3
    assert projection(capsys, "--engine-starts", "per-shard")["bound"].startswith("engine starts")
    # Eight TP1 engines start side by side: 300 shards need 38 starts each (37.5 rounded up).
    assert projection(capsys, "--engine-starts", "per-shard", "--tp", "1")["engine_starts"] == 38
    # A start from the checkpoint's bytes: 540 GB at the disk's 2 GB/s plus a fixed 600 s.
    from_checkpoint = projection(capsys, "--engine-fixed-seconds", "600", "--disk-gbps", "2")
    assert from_checkpoint["inputs"]["engine_start_seconds"] == pytest.approx(540 / 2 + 600)


def test_goal_is_met_when_nothing_but_compute_is_left(capsys):
    result = projection(capsys, "--prefill-tps", "2280", "--disk-gbps", "1000", "--pack-gbps", "1000",
                        "--extract-over-bare", "1", "--shard-size", "1000", "--validate-gbps", "1000")
    assert result["gpu_busy_share"] >= result["goal"]


def test_command_prints_stages_and_json():
    run = [sys.executable, "-m", "eagle3bench.projection"]
    text = subprocess.run(run, cwd=REPO, capture_output=True, text=True, check=True).stdout
    for stage in ("tokenize", "engine start", "extract", "validate", "pack", "exports"):
        assert any(line.startswith(stage) for line in text.splitlines()), stage
    assert "bound: disk during extraction" in text and "GPU-busy share" in text and "derived, assumed" in text
    as_json = json.loads(subprocess.run([*run, "--json"], cwd=REPO, capture_output=True, text=True,
                                        check=True).stdout)
    assert f"{as_json['gpu_busy_share']:.3f}" in text
    assert subprocess.run([*run, "--help"], cwd=REPO, capture_output=True).returncode == 0


def test_exports_at_their_default_hold_no_states_and_files_exports_copy_them(capsys):
    from eagle3data.plan.disk import ExportShape, export_bytes

    none = projection(capsys)
    readers = projection(capsys, "--reader-exports", "speculators,specforge")
    files = projection(capsys, "--exports", "2")
    shape = ExportShape(samples=300_000, tokens=300_000 * 400, states_per_token=4, hidden_size=7168, itemsize=2)
    small = export_bytes("speculators", "reader", shape) + export_bytes("specforge", "reader", shape)
    stage = {r: {s["stage"]: s for s in p["stages"]}["exports"] for r, p in
             (("none", none), ("readers", readers), ("files", files))}
    assert stage["none"]["disk_bytes"] == 0 and stage["readers"]["disk_bytes"] == small
    assert small < 0.001 * none["state_bytes"]  # 400-token rows: the table and a block a row
    assert stage["readers"]["seconds"] == pytest.approx(small / (readers["inputs"]["disk_gbps"] * 1e9))
    assert stage["files"]["disk_bytes"] == pytest.approx(4 * files["state_bytes"])  # each read and written
    pack = {s["stage"]: s for s in files["stages"]}["pack"]["seconds"]
    assert stage["files"]["seconds"] == pytest.approx(2 * pack)
    assert none["wall_seconds"] < readers["wall_seconds"] < none["wall_seconds"] + 60 < files["wall_seconds"]
