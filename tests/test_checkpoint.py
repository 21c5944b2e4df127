"""The loader choices (engine.load_format, engine.load_threads): the sharded_state checkpoint written by
its rule with a real engine, what an engine start checks in it, and the refusals at config time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open

from conftest import REPO, demo_config, run_snakemake
from eagle3data.checkpoint import MARKER, CheckpointError, check_loadable, check_loader_config, write_sharded
from eagle3data.engine import engine_kwargs, generation_engine_kwargs
from eagle3data.layers import parse_captures
from eagle3data.settings import engine_config


def test_the_rule_writes_the_sharded_checkpoint_before_any_engine_job_plans_to_load_it(tmp_path):
    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    config["engine"].update(load_format="sharded_state", sharded_checkpoint=str(tmp_path / "kimi-tp8"))
    (tmp_path / "kimi.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--nolock", "--cores", "all", "--resources", "gpu=8",
         "--configfile", str(tmp_path / "kimi.yaml")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = proc.stdout
    writing = plan.index(f"Writing the per-rank (sharded_state) checkpoint of /models/Kimi-K2.5 at {tmp_path}/kimi-tp8")
    assert writing < plan.index("Extracting hidden states for shard 00000 (8 GPUs")
    assert plan.count("Writing the per-rank") == 1  # once, for every shard's engine


def test_loader_settings_that_cannot_work_are_refused_before_any_job(tmp_path):
    proc = run_snakemake(tmp_path, "-n", config=demo_config(engine={"load_format": "sharded_state"}), check=False)
    assert proc.returncode != 0
    assert "engine.load_format sharded_state needs engine.device cuda" in proc.stdout + proc.stderr
    with pytest.raises(CheckpointError, match=r"engine.load_threads \(8\) is a setting of vLLM's default loader"):
        check_loader_config(engine_config({"load_format": "sharded_state", "device": "cuda", "load_threads": 8}))


def test_load_threads_reach_vllms_default_loader():
    engine = engine_config({"load_threads": 8})
    kwargs = engine_kwargs("/m", parse_captures([{"layer": 1, "point": "input"}], 4), "bfloat16", 64, engine,
                           False, "/store")
    assert kwargs["model"] == "/m" and kwargs["load_format"] == "auto"
    assert kwargs["model_loader_extra_config"] == {"enable_multithread_load": True, "num_threads": 8}


def test_a_real_engine_saves_each_ranks_weights_and_the_model_files(smollm2, tiny_deepseek, tmp_path):
    with pytest.raises(CheckpointError, match="an MLA model .deepseek_v3. cannot be saved"):  # before loading
        write_sharded(str(tiny_deepseek), "bfloat16", engine_config({}), False, tmp_path / "mla")
    assert not list(tmp_path.iterdir())

    out = tmp_path / "model.sharded-tp1"
    engine = engine_config({"cpu_kv_cache_gib": 1})
    record = write_sharded(str(smollm2), "bfloat16", engine, False, out)

    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no temporary directory left
    assert record["files"] == ["model-rank-0-part-0.safetensors"] and record["tensor_parallel_size"] == 1
    assert json.loads((out / MARKER).read_text()) == record
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (smollm2 / name).read_bytes(), name
    # The saved state is the loaded model's: a weight vLLM keeps as it is equals the checkpoint's.
    key = "model.layers.0.input_layernorm.weight"
    with safe_open(str(out / record["files"][0]), "pt") as saved, \
            safe_open(str(next(smollm2.glob("*.safetensors"))), "pt") as source:
        assert saved.get_tensor(key).equal(source.get_tensor(key).to(torch.bfloat16))

    sharded = dict(engine, load_format="sharded_state", sharded_checkpoint=str(out), device="cuda")
    check_loadable(generation_engine_kwargs(str(smollm2), "bfloat16", 64, sharded, False))
    with pytest.raises(CheckpointError, match="written for tensor_parallel_size 1 in bfloat16, the engine asks for 2"):
        check_loadable(generation_engine_kwargs(str(smollm2), "bfloat16", 64,
                                                dict(sharded, tensor_parallel_size=2), False))
    (out / MARKER).unlink()
    with pytest.raises(CheckpointError, match="not a finished sharded_state checkpoint"):
        check_loadable(generation_engine_kwargs(str(smollm2), "bfloat16", 64, sharded, False))
