"""Run speculators 0.9's EAGLE-3 trainer on CPU, recording its metrics, without editing the library.

Used by figure 8 (eagle3bench.acceptance) and tests/test_trainers.py.

The CLI puts the model on accelerator 0 ("Cannot access accelerator device" here) and synchronizes it;
this wrapper makes the trainer's local rank "cpu" and the synchronize a no-op, runs Muon's bf16 Newton-Schulz step through float32 products on a CPU
without bf16 instructions (eagle3bench.muon_cpu), and appends every metrics record the trainer
logs (train steps, validation epochs) as one JSON line to METRICS_JSONL.

    python -m eagle3bench.speculators_cpu METRICS_JSONL <speculators train flags>
"""

from __future__ import annotations

import json
import logging
import sys

import torch


class JsonLines(logging.Handler):
    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": getattr(record, "step", None), **record.msg}, default=str) + "\n")


def main() -> None:
    metrics_path, *flags = sys.argv[1:]
    from speculators.train import cli, trainer
    from speculators.train.config import TrainConfig

    import eagle3data.exports.speculators_reader  # noqa: F401  (registers --hidden-states-backend eagle3data)
    from eagle3bench import muon_cpu

    if muon_cpu.use_where_bf16_is_slow():
        print("eagle3data: no bf16 instructions on this CPU: Muon's Newton-Schulz in float32 products "
              "rounded to bf16", flush=True)

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    setup_metric_logger = cli.setup_metric_logger

    def setup_and_record(*args, **kwargs):
        setup_metric_logger(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(JsonLines(metrics_path))

    cli.setup_metric_logger = setup_and_record
    sys.argv = [sys.argv[0], *flags]
    cli.main(TrainConfig.resolve())


if __name__ == "__main__":
    main()
