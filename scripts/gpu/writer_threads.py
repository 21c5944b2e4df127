"""Diagnostic (figure 7): how fast N writer threads write states files the connector's way, and
how much they delay a Python thread beside them (vLLM's engine thread, which needs Python's lock between
forward passes). No vLLM, no GPU work: the connector's own per-file steps on pinned host memory.

    python3 scripts/gpu/writer_threads.py --dir /dev/shm/writers --out writers.json

Variants: `connector` (written_facts, then save_file through atomic_path(durable=False): what the writer
threads do), `facts` and `save_file` alone, `plain` (the same bytes as save_file writes, from Python's
unbuffered file write of the pinned memory) and `facts+plain`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


from eagle3data.contracts.measuring import measured, written_facts
from eagle3data.contracts.states import FACTS_KEY
from eagle3data.storage.store import atomic_path


def plain_write(path: str, states: torch.Tensor, token_ids: torch.Tensor, metadata: dict) -> None:
    """A safetensors file written without the library: header, then the tensors' memory as it is."""
    sizes = [states.numel() * states.element_size(), token_ids.numel() * token_ids.element_size()]
    header = {"__metadata__": metadata,
              "hidden_states": {"dtype": "BF16", "shape": list(states.shape), "data_offsets": [0, sizes[0]]},
              "token_ids": {"dtype": "I64", "shape": list(token_ids.shape), "data_offsets": [sizes[0], sum(sizes)]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb", buffering=0) as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.write(memoryview(states.view(torch.uint8).numpy().reshape(-1)))
        f.write(memoryview(token_ids.numpy().view(np.uint8)))


def save_with_library(path: str, states: torch.Tensor, token_ids: torch.Tensor, metadata: dict) -> None:
    save_file({"hidden_states": states, "token_ids": token_ids}, path, metadata=metadata)


# name: (how each file's facts are measured, or None: measured once beforehand; how it is written, or None)
VARIANTS = {
    "connector": (written_facts, save_with_library),
    "facts": (written_facts, None),
    "save_file": (None, save_with_library),
    "plain": (None, plain_write),
    "facts+plain": (written_facts, plain_write),
}


def variant(name: str, states: torch.Tensor, token_ids: torch.Tensor, measures: torch.Tensor):
    measure, writer = VARIANTS[name]
    norms, low = measures[:, 0], measures[:, 1]
    fixed = {FACTS_KEY: written_facts(states, norms, low)}

    def write(path: str) -> None:
        facts = {FACTS_KEY: measure(states, norms, low)} if measure else fixed
        if writer:
            with atomic_path(path, durable=False) as tmp:
                writer(tmp, states, token_ids, facts)
    return write


def probe(stop: threading.Event, delays: list[float]) -> None:
    """A small piece of Python work every 1 ms, timed with the wait to get Python's lock back after each
    pause: how long the engine's thread would take for it between two forward passes."""
    began = time.perf_counter()
    while not stop.is_set():
        sum(range(2000))
        time.sleep(0.001)
        now = time.perf_counter()
        delays.append(now - began - 0.001)
        began = now


@contextlib.contextmanager
def probing() -> Iterator[list[float]]:
    """The probe's step times while the block runs."""
    stop, delays = threading.Event(), []
    prober = threading.Thread(target=probe, args=(stop, delays))
    prober.start()
    try:
        yield delays
    finally:
        stop.set()
        prober.join()


def run(name: str, threads: int, files: int, directory: Path, tensors) -> dict:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    write = variant(name, *tensors)
    with probing() as delays:
        began = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda i: write(str(directory / f"{i:06d}.safetensors")), range(files)))
        seconds = time.perf_counter() - began
    return {"variant": name, "threads": threads, "files": files, "files_per_s": files / seconds,
            "probe_median_us": statistics.median(delays) * 1e6, "probe_p99_us": np.percentile(delays, 99) * 1e6,
            "probe_share_of_time": sum(delays) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=175)  # figure 7's mean conversation
    parser.add_argument("--captures", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)  # the 8B shape
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--threads", default="1,8,16")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    pin = torch.cuda.is_available()
    states = torch.randn(args.tokens, args.captures, args.hidden).to(torch.bfloat16)
    states = states.pin_memory() if pin else states
    tensors = (states, torch.arange(args.tokens), measured(states))
    with probing() as idle:
        time.sleep(1)
    results = {"shape": [args.tokens, args.captures, args.hidden], "pinned": pin, "torch_threads": torch.get_num_threads(),
               "probe_idle_median_us": statistics.median(idle) * 1e6, "runs": []}
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}), flush=True)
    for threads in map(int, args.threads.split(",")):
        for name in args.variants.split(","):
            r = run(name, threads, args.files, args.dir, tensors)
            results["runs"].append(r)
            print(f"{name:12s} threads {threads:2d}: {r['files_per_s']:7.1f} files/s; probe median "
                  f"{r['probe_median_us']:7.1f} us, p99 {r['probe_p99_us']:8.1f} us, {r['probe_share_of_time']:.3f} of "
                  f"the time", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
