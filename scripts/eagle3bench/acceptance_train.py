"""Train one EAGLE-3 draft for figure 8 with speculators 0.9's trainer on CPU, by a fixed recipe.

Every arm gets the same recipe (stated in the figure's output), so arms differ only in their data. The
trainer validates on the training directory's last rows, which acceptance_data puts there: the
target's own greedy answers to the held-out prompts, so its last validation record is the draft's
teacher-forced accuracy on exactly what the target says when served.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3bench.acceptance_data import LAYER_IDS


@dataclass(frozen=True)
class Recipe:
    epochs: int
    lr: float
    draft_vocab: int
    total_seq_len: int
    target_layer_ids: tuple[int, ...] = tuple(LAYER_IDS)
    optimizer: str = "muon"  # speculators 0.9's default; its AdamW group takes the same lr
    ttt_steps: int = 3

    def flags(self) -> list[str]:
        return ["--speculator-type", "eagle3", "--target-layer-ids", *map(str, self.target_layer_ids),
                "--draft-vocab-size", str(self.draft_vocab), "--total-seq-len", str(self.total_seq_len),
                "--epochs", str(self.epochs), "--lr", str(self.lr), "--optimizer", self.optimizer,
                "--ttt-steps", str(self.ttt_steps),
                # CPU: no flex attention backward, no Triton loss, no vLLM server to fill gaps.
                "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype",
                "float32", "--on-missing", "raise", "--num-workers", "0", "--log-freq", "1"]

    def stated(self) -> dict:
        return {**asdict(self), "trainer": "speculators 0.9.0 on CPU (eagle3bench.speculators_cpu)"}


def train(model: Path, data: Path, n_train: int, n_total: int, recipe: Recipe, out: Path, log: Path,
          seed: int = 0) -> dict:
    """Train on `data` (first `n_train` of `n_total` rows; the rest validate); the draft's directory,
    its per-epoch validation metrics and its step count."""
    metrics = out / "metrics.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    ratio = (n_train + 0.5) / n_total  # the trainer splits at int(rows * ratio): exactly n_train
    cmd = [sys.executable, "-m", "eagle3bench.speculators_cpu", str(metrics),
           "--verifier-name-or-path", str(model), "--data-path", str(data), *recipe.flags(),
           "--train-data-ratio", repr(ratio), "--seed", str(seed), "--save-path", str(out / "checkpoints")]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=out)
    if proc.returncode != 0:
        raise RuntimeError(f"speculators training failed ({proc.returncode}); see {log}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_records = [r for r in records if "train" in r]
    if any(r["train"]["error_records"] for r in train_records):
        raise RuntimeError(f"the trainer dropped rows whose token ids differ from input ids; see {log}")
    val = [r["val"] for r in records if "val" in r]
    epochs = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    return {"draft": str(out / "checkpoints" / str(epochs[-1])), "steps": len(train_records),
            "val_by_epoch": val,
            "teacher_forced_acc": [val[-1][f"full_acc_{k}_epoch"] for k in range(recipe.ttt_steps)],
            "teacher_forced_cond_acc": [val[-1][f"cond_acc_{k}_epoch"] for k in range(recipe.ttt_steps)]}


@dataclass(frozen=True)
class Sizes:
    train_conversations: int
    heldout_prompts: int
    max_tokens: int  # new tokens per held-out prompt when served
    regenerate_tokens: int  # arm (c): regenerate.max_new_tokens (longer answers are kept, truncated)
    recipe: Recipe


SIZES = {
    "quick": Sizes(64, 12, 48, 128, Recipe(epochs=3, lr=3e-3, draft_vocab=2048, total_seq_len=256)),
    # full: 6 epochs at lr 3e-3 (~220 optimizer steps of 512 tokens for 192 conversations); 2 epochs at 1e-3
    # (74 steps) under-trained: (d) read only 0.97 of (a) (docs/benchmarks.md).
    "full": Sizes(192, 48, 96, 256, Recipe(epochs=6, lr=3e-3, draft_vocab=4096, total_seq_len=512)),
}
