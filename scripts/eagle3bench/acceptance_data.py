"""Figure 8's training data: real Snakemake runs of this pipeline (speculators export enabled), and the
per-arm training directories built from their exports.

Arm (a)'s run also carries, after its training conversations, the evaluation conversations (the
held-out prompts with the target's own greedy answers); every arm's training directory ends with
those rows, which the trainer validates on: its validation split is exactly the teacher-forced
control the figure reports, the same rows for every arm. Arm (d) rolls each training row's states by one token
(`torch.roll(states, 1, dims=0)`), a misalignment that every structural check would miss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from eagle3data.utils.checkout import REPO

CAPTURES = [{"layer": 2, "point": "input"}, {"layer": 15, "point": "input"},
            {"layer": 27, "point": "input"}, {"layer": 29, "point": "output"}]
LAYER_IDS = [2, 15, 27]  # speculators' --target-layer-ids for SmolLM2-135M (30 layers)


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def pipeline_config(run: str, conversations: Path, model: Path, draft_vocab: int, extra: dict | None = None) -> dict:
    return {
        "run": run, "input": str(conversations), "shard_size": 512,
        "model": {"path": str(model), "build_demo": False, "dtype": "bfloat16", "hidden_size": 576,
                  "num_hidden_layers": 30},
        "captures": CAPTURES, "sequence": {"max_seq_len": 512, "min_seq_len": 8},
        "draft_vocab_size": draft_vocab,
        "engine": {"device": "cpu", "max_num_batched_tokens": 4096, "max_num_seqs": 64, "batch_samples": 256,
                   "cpu_kv_cache_gib": 1},
        # The arms' training directories link the export's per-row files: states files, not the reader.
        "export": {"speculators": {"enabled": True, "states": "files"}},
        **(extra or {}),
    }


def run_pipeline(workdir: Path, config: dict, log: Path) -> Path:
    """Run the real workflow in `workdir` with `config`; its speculators export directory."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = workdir / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--cores", "2", "--configfile", str(config_file)]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=workdir,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"snakemake failed ({proc.returncode}); see {log}")
    return workdir / "results" / config["run"] / "export" / "speculators"


def check_order(export: Path, model: Path, prompts: list[str]) -> None:
    """The export holds one row per conversation, in input order (pack keeps it): row i has prompt i."""
    from datasets import load_from_disk
    from transformers import AutoTokenizer

    rows, tokenizer = load_from_disk(str(export)), AutoTokenizer.from_pretrained(str(model))
    if len(rows) != len(prompts):
        raise RuntimeError(f"{export}: {len(rows)} rows for {len(prompts)} conversations (some were skipped)")
    for i, prompt in enumerate(prompts):
        if prompt not in tokenizer.decode(rows[i]["input_ids"]):
            raise RuntimeError(f"{export}: row {i} does not hold prompt {i} ({prompt!r})")


def training_dir(train: Path, n_train: int, evaluation: Path, n_eval: int, out: Path, shift: bool = False,
                 train_rows: list[int] | None = None) -> None:
    """Write `out` in speculators' layout: the first `n_train` rows of the export `train`, or its rows
    `train_rows` in that order (speculators' own data is shuffled), states rolled by one token when
    `shift`; then the last `n_eval` rows of the export `evaluation`, never rolled,
    for validation. Token counts are taken over the training rows alone (trainable tokens, as the
    pipeline counts them), so the trainer derives the draft vocabulary without seeing the validation
    answers."""
    from collections import Counter

    from datasets import concatenate_datasets, load_from_disk

    columns = ["input_ids", "loss_mask", "seq_len"]
    a, b = load_from_disk(str(train)).select_columns(columns), load_from_disk(str(evaluation)).select_columns(columns)
    first_eval = len(b) - n_eval
    picked = list(range(n_train)) if train_rows is None else train_rows
    # cast: speculators' own rows are int64 throughout, the export's int32/int8 (the values agree)
    rows = concatenate_datasets([a.select(picked).cast(b.features), b.select(range(first_eval, len(b)))])
    rows.set_format("torch")
    rows.save_to_disk(str(out))
    counts = Counter()
    for row in rows.select(range(n_train)):
        counts.update(row["input_ids"][row["loss_mask"] == 1].tolist())
    torch.save(dict(counts), out / "token_freq.pt")
    states = out / "hidden_states"
    states.mkdir()
    for i in range(n_train):
        source = train / "hidden_states" / f"hs_{picked[i]}.safetensors"
        if shift:
            tensors = load_file(str(source))
            tensors["hidden_states"] = torch.roll(tensors["hidden_states"], 1, dims=0)
            save_file(tensors, str(states / f"hs_{i}.safetensors"))
        else:
            os.symlink(source, states / f"hs_{i}.safetensors")
    for j in range(n_eval):
        os.symlink(evaluation / "hidden_states" / f"hs_{first_eval + j}.safetensors",
                   states / f"hs_{n_train + j}.safetensors")
