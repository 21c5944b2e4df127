"""Figure 8's arm (e): arm (a)'s data, as this pipeline exports it for SpecForge, trained by SpecForge 0.2.

The same conversations and the same states as (a), read through SpecForge's own offline reader from
`export/specforge` (one `.ckpt` per sample, the final state after the target's norm), and a draft trained
by SpecForge's trainer (bench.specforge_train; on CPU, or on a GPU by `python -m
eagle3bench.acceptance_specforge`) with the figure's recipe where SpecForge has the knob
(epochs, learning rate, draft vocabulary, sequence length, 3 positions, seed); its optimizer is its own
(AdamW over fp32 master weights; speculators' is Muon). What SpecForge needs beside the export, written
here for each run, is what a user of the export needs:

- the target's directory with a `*.index.json`: SpecForge finds the LM head only through one, and a
  single-file checkpoint such as SmolLM2's has none. A view of the target's files (symlinks) plus an
  index listing every tensor; `model.lm_head_key: model.embed_tokens.weight` for a target that ties its
  head to its embedding.
- a draft config whose `draft_vocab_size` is the export's (`vocab_mapping.pt`): otherwise SpecForge
  generates one with 32,000 and loading the mapping fails. Made by SpecForge's own generator
  (`draft_config_dict`) with the export's size, plus the aux layers in vLLM's numbering
  (`eagle_aux_hidden_state_layer_ids`) for serving.
- `model.aux_hidden_state_layer_ids` from the export's manifest (SGLang's numbering, output of layer k).

Training rows are links to the export's first n_train feature files, validation rows to its last n_eval
(the target's own answers: SpecForge's evaluator scores them at the end of every epoch). The draft
served is the last epoch's, written by `specforge export --to sglang` (the layout vLLM loads as `eagle3`).
On CPU the run config asks for DDP and SDPA attention (specforge_train says why); on a GPU it keeps
SpecForge's defaults (FSDP, flex attention, its Triton loss).

    python -m eagle3bench.acceptance_specforge EXPORT_DIR --model M --train 64 --eval 12 --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from eagle3bench.acceptance_train import SIZES, Recipe

# On CPU: DDP over gloo (SpecForge's FSDP refuses CPU) and SDPA attention (flex attention has no backward
# on CPU; SpecForge's eagle3 offers fa, flex_attention, sdpa, usp). On a GPU, SpecForge's defaults.
CPU_TRAINING = {"attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD"}


def target_view(model: Path, out: Path) -> Path:
    """`model`'s files by symlink, with an index naming each tensor's file when it has none."""
    out.mkdir(parents=True)
    for f in model.iterdir():
        (out / f.name).symlink_to(f.resolve())
    if not list(model.glob("*.index.json")):
        weight_map = {}
        for weights in sorted(model.glob("*.safetensors")):
            with safe_open(str(weights), "pt") as f:
                weight_map.update({key: weights.name for key in f.keys()})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def linked_rows(features: list[Path], out: Path) -> Path:
    """A directory of links to `features`, in order: SpecForge reads every `*.ckpt` under a path, sorted."""
    out.mkdir(parents=True)
    for i, f in enumerate(features):
        (out / f"data_{i:08d}.ckpt").symlink_to(f.resolve())
    return out


def run_config(export: Path, manifest: dict, target: Path, train_rows: Path, eval_rows: Path, n_train: int,
               recipe: Recipe, seed: int, out: Path) -> dict:
    with safe_open(str(next(target.glob("*.safetensors"))), "pt") as f:
        tied = "lm_head.weight" not in f.keys()
    return {
        "model": {"target_model_path": str(target), "aux_hidden_state_layer_ids": manifest["layer_ids"],
                  "vocab_mapping_path": str(export / "vocab_mapping.pt"), "torch_dtype": "bfloat16",
                  **({"lm_head_key": "model.embed_tokens.weight"} if tied else {})},
        "data": {"hidden_states_path": str(train_rows), "eval_hidden_states_path": str(eval_rows),
                 "max_length": recipe.total_seq_len, "dataloader_num_workers": 0},
        "training": {"strategy": "eagle3", "num_epochs": recipe.epochs, "learning_rate": recipe.lr,
                     "ttt_length": recipe.ttt_steps, "eval_interval": n_train, "log_interval": 1, "seed": seed,
                     **({} if torch.cuda.is_available() else CPU_TRAINING)},
        "deployment": {"trainer": {"nproc_per_node": 1}},
        "output_dir": str(out),
    }


def draft_config(run_yaml: Path, draft_vocab: int, layer_ids: list[int], out: Path) -> Path:
    """SpecForge's generated draft config for the run, with the export's vocabulary size and its aux
    layers (`layer_ids`, SGLang's numbering) as vLLM numbers them (the input of the next layer)."""
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.training.model_loading import draft_config_dict

    resolved = resolve_run(load_config(str(run_yaml), []))
    config = draft_config_dict(resolved.config, provider=resolved.algorithm.providers.model.draft_config)
    config.update(draft_vocab_size=draft_vocab, eagle_aux_hidden_state_layer_ids=[k + 1 for k in layer_ids])
    out.write_text(json.dumps(config, indent=1))
    return out


def train_specforge(export: Path, n_train: int, n_eval: int, model: Path, recipe: Recipe, out: Path, log: Path,
                    seed: int = 0) -> dict:
    """Train on the export's first `n_train` rows, validate on its last `n_eval`; the served draft's
    directory, SpecForge's per-epoch evaluations and its step count."""
    features = sorted((export / "hidden_states").glob("*.ckpt"))
    manifest = json.loads((export / "eagle3_export.json").read_text())
    out.mkdir(parents=True)
    train_rows, eval_rows = linked_rows(features[:n_train], out / "train"), linked_rows(features[-n_eval:], out / "eval")
    config = run_config(export, manifest, target_view(model, out / "target"), train_rows, eval_rows, n_train, recipe,
                        seed, out / "run")
    run_yaml = out / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(config))  # SpecForge generates the draft config from this run
    config["model"]["draft_model_config"] = str(
        draft_config(run_yaml, manifest["draft_vocab_size"], manifest["layer_ids"], out / "draft-config.json"))
    run_yaml.write_text(yaml.safe_dump(config))
    metrics = out / "metrics.jsonl"
    with open(log, "w") as f:
        cmd = [sys.executable, "-m", "eagle3bench.specforge_train", str(metrics), "train", "--config",
               str(run_yaml)]
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out).returncode != 0:
            raise RuntimeError(f"SpecForge training failed; see {log}")
        last = max((out / "run").glob("specforge-run-step*"), key=lambda p: int(p.name.rsplit("step", 1)[1]))
        cmd = [sys.executable, "-m", "eagle3bench.specforge_train", str(metrics), "export", "--to", "sglang",
               "--checkpoint", str(last), "--draft-config", str(out / "draft-config.json"),
               "--output-dir", str(out / "draft"), "--vocab-mapping", str(export / "vocab_mapping.pt")]
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out).returncode != 0:
            raise RuntimeError(f"SpecForge's export of the draft failed; see {log}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in records if "eval/avg_loss" in r]
    acc = [evals[-1][f"eval/per_position_acc/{k}"] for k in range(recipe.ttt_steps)]
    return {"draft": str(out / "draft"), "steps": sum("loss" in r for r in records), "val_by_epoch": evals,
            "teacher_forced_acc": acc, "trainer": f"specforge 0.2.0 on {device()} (eagle3bench.specforge_train)"}


def device() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("export", type=Path, help="a SpecForge export of this pipeline (export/specforge)")
    parser.add_argument("--model", type=Path, required=True, help="the target checkpoint")
    parser.add_argument("--train", type=int, required=True, help="the export's first N rows train")
    parser.add_argument("--eval", type=int, required=True, help="its last N rows validate")
    parser.add_argument("--quick", action="store_true", help="figure 8's quick recipe (else its full one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="work directory (new); the draft lands in OUT/draft")
    args = parser.parse_args()
    recipe = SIZES["quick" if args.quick else "full"].recipe
    trained = train_specforge(args.export.resolve(), args.train, args.eval, args.model.resolve(), recipe,
                              args.out.resolve(), args.out.resolve() / "train.log", args.seed)
    (args.out / "trained.json").write_text(json.dumps(trained, indent=1))
    print(json.dumps({k: v for k, v in trained.items() if k != "val_by_epoch"}))


if __name__ == "__main__":
    main()
