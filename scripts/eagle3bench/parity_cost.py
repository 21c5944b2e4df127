"""Figure 13: what the parity gate (validate/parity.py) costs a production run, projected from its work
measured on this machine at Kimi-K2.5's shapes.

At Kimi-K2.5's size the gate's reference (transformers' float32 forward up to the first capture, ~75 GiB
of weights) does not fit the default `parity.reference_memory_gib`, so its work is the final-capture check:
in each validate job, the checkpoint's final norm and output head (163,840 x 7,168 bf16, 2.35 GB) read by
name from a cold file, then, per witnessed sample, the head over POSITIONS positions in float32. A random
head of that shape is written as safetensors, dropped from the page cache and put through that work, three
runs, the worst first.

Projected (bench.projection's default run: 300,000 conversations, 8 GPUs, TP8): a validate job runs on the
CPU beside later extract jobs, off the GPUs' path, except the last shard's, which delays the dataset by
its gate seconds; on the GPUs the gate adds the witnessed samples' prompt log-probabilities, their tokens
through the output head (2 x hidden x vocabulary FLOPs a token) against every token's forward pass (2 x
active parameters), assumed compute-bound like the prefill. Figure 13 = (the last shard's gate seconds +
the run's GPU seconds of log-probabilities) / the run's extract seconds. Nothing here ran on a GPU.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3bench import projection
from eagle3bench.files import drop_from_page_cache
from eagle3data.model.weights import NORM_NAMES, FinalNorm, output_head, read_tensor, tensor_files
from eagle3data.validate.parity import POSITIONS, next_token_log_probs

KIMI_HIDDEN, KIMI_VOCAB, KIMI_ACTIVE_PARAMS = 7168, 163_840, 32e9
SAMPLES_PER_SHARD = 2  # parity.samples_per_shard's default
SHARD_SIZE = 1_000  # bench.projection's default


def gate_seconds(model_dir: Path) -> float:
    """One validate job's gate work on the checkpoint at `model_dir`, its file cold: the final norm and
    head read by name (mapped: their pages are read as the matmul reaches them) and applied."""
    drop_from_page_cache([str(model_dir / "model.safetensors")])
    states = (torch.randn(SAMPLES_PER_SHARD * POSITIONS, KIMI_HIDDEN) * 4).to(torch.bfloat16)
    next_ids = torch.randint(0, KIMI_VOCAB, (len(states),)).tolist()
    began = time.perf_counter()
    files = tensor_files(model_dir)
    next_token_log_probs(states, next_ids, FinalNorm(read_tensor(model_dir, NORM_NAMES, files)[1].float(), 1e-6,
                                                     "random"), output_head(model_dir, files)[1])
    return time.perf_counter() - began


def measure(work: Path, runs: int = 3) -> dict:
    """The gate's work `runs` times on a head written under `work` (on the disk measured), and figure 13."""
    model_dir = work / "kimi-head"
    model_dir.mkdir(parents=True, exist_ok=True)
    head = (torch.randn(KIMI_VOCAB, KIMI_HIDDEN) * 0.02).to(torch.bfloat16)
    save_file({"lm_head.weight": head, "model.norm.weight": torch.ones(KIMI_HIDDEN, dtype=torch.bfloat16)},
              str(model_dir / "model.safetensors"))
    del head
    try:
        measured = sorted((gate_seconds(model_dir) for _ in range(runs)), reverse=True)
    finally:
        shutil.rmtree(model_dir)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        projection.main(["--json"])
    run = json.loads(out.getvalue())
    gpu_share = (SAMPLES_PER_SHARD * KIMI_HIDDEN * KIMI_VOCAB) / (SHARD_SIZE * KIMI_ACTIVE_PARAMS)
    extract = next(s["seconds"] for s in run["stages"] if s["stage"] == "extract")
    ratios = [(seconds + gpu_share * run["gpu_busy_seconds"]) / extract for seconds in measured]
    return {"gate_seconds_worst_first": measured, "ratios_worst_first": ratios, "extract_seconds": extract,
            "gpu_busy_seconds": run["gpu_busy_seconds"], "log_prob_gpu_share": gpu_share,
            "positions": POSITIONS, "samples_per_shard": SAMPLES_PER_SHARD}


def describe(r: dict) -> str:
    return (f"the last shard's gate {r['gate_seconds_worst_first'][0]:.1f} s (Kimi-K2.5's head read cold and "
            f"{r['samples_per_shard']} samples x {r['positions']} positions through it, this CPU) and prompt "
            f"log-probabilities on {r['log_prob_gpu_share']:.1e} of the GPU time, over {r['extract_seconds']:,.0f} s "
            "of extraction (projected: Kimi-K2.5, 300,000 conversations, 8 GPUs); every other shard's gate runs "
            "beside the GPUs")
