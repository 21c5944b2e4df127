"""Run SpecForge 0.2's offline EAGLE-3 trainer, recording its metrics, on a GPU or on CPU, without editing
the library.

Used by figure 8's arm (e) (eagle3bench.acceptance_specforge). Every metrics record the trainer
logs (train steps, evaluations) is appended as one JSON line to METRICS_JSONL, and
eagle3data.exports.specforge_reader is installed (a reader export trains too). Without a GPU, SpecForge picks
CPU and gloo by itself, and two things stand in the way. Its FSDP wrapper refuses CPU, but the run
config's `training.fsdp_sharding: NO_SHARD` makes it wrap the draft in DDP, which gloo runs (the run
config sets that, acceptance_specforge.run_config). And its KL loss is a Triton kernel
(`LogSoftmaxLoss`), which needs a GPU driver: here it is replaced by the same loss in eager torch, as
the kernel's own reference (`specforge.core.loss._compute_loss`) writes it, without that reference's
torch.compile (tests/test_acceptance.py compares the two, values and gradients).

    python -m eagle3bench.specforge_train METRICS_JSONL train --config run.yaml
    python -m eagle3bench.specforge_train METRICS_JSONL export --to sglang ...
"""

from __future__ import annotations

import json
import sys

import torch


class EagerLogSoftmaxLoss:
    """SpecForge's KL loss: mean over positions of -sum_v(mask * target_p * log_softmax(logits))."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        log_p = torch.log_softmax(logits.float(), dim=-1)
        return -(position_mask * target_p * log_p).sum(-1).mean()


def record_metrics(path: str) -> None:
    """Append what SpecForge's trainer logs, step by step, to `path` as JSON lines (its console logger,
    the one a run without `tracking.report_to` gets)."""
    from specforge.training import assembly
    from specforge.training.tracking import scalar_metrics

    console = assembly._logger

    def log_and_record(metrics, step):
        console(metrics, step)
        with open(path, "a") as f:  # lists and tensors as "name/index" keys, as SpecForge's trackers get them
            f.write(json.dumps({"step": step, **scalar_metrics(metrics)}) + "\n")

    assembly._logger = log_and_record


def main() -> None:
    metrics_path, *argv = sys.argv[1:]
    from specforge.algorithms.eagle3 import model
    from specforge.cli import main as specforge_main

    from eagle3data.exports.specforge_reader import install

    if not torch.cuda.is_available():
        model.LogSoftmaxLoss = EagerLogSoftmaxLoss
    install()
    record_metrics(metrics_path)
    sys.exit(specforge_main(argv))


if __name__ == "__main__":
    main()
