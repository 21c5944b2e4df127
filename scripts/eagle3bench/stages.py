"""Benchmark figures 4, 5, 7, 10 and 11: tokenize, planning, a whole run and its disk footprint, on
synthetic conversations.

Conversations are the demo's (data/demo/conversations.jsonl: ShareGPT and OpenAI forms, long ones that
truncate, ones without an assistant turn), repeated with a numbered variant of the first turn so that
every one is distinct. Planning uses short synthetic conversations: only their count matters to it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import pandas as pd
import pyarrow.compute as pc
import yaml

from eagle3data.utils.checkout import REPO
from eagle3data.inputs.conversations import normalize_messages
from eagle3data.engine.start import EngineSettings
from eagle3data.inputs.tokenization import tokenize_shard

DEMO = REPO / "data" / "demo" / "conversations.jsonl"


def write_conversations(path: Path, count: int) -> Path:
    """`count` distinct demo-like conversations, one JSON object a line."""
    demo = [json.loads(line) for line in DEMO.read_text().splitlines() if line.strip()]
    with open(path, "w") as f:
        for i in range(count):
            record = json.loads(json.dumps(demo[i % len(demo)]))
            turns = record.get("messages") or record.get("conversations")
            key = "content" if "messages" in record else "value"
            turns[0][key] = f"{turns[0][key]} (variant {i})"
            f.write(json.dumps(record) + "\n")
    return path


def write_planning_input(path: Path, count: int) -> Path:
    """`count` short conversations, written in blocks (planning only counts them)."""
    line = '{{"id": "plan-{0}", "messages": [{{"role": "user", "content": "Question {0}?"}}, ' \
           '{{"role": "assistant", "content": "Answer {0}."}}]}}\n'
    with open(path, "w") as f:
        for start in range(0, count, 10_000):
            f.write("".join(line.format(i) for i in range(start, min(start + 10_000, count))))
    return path


def measure_tokenize(work: Path, model: str, conversations: int, sequence: dict) -> dict:
    """Samples/s of the tokenize stage (read, render, mask, check, write) and of the bare tokenizer
    encoding the same conversations' rendered texts in one batch; tokenizer loading not timed."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    source = write_conversations(work / "tokenize-input.jsonl", conversations)
    began = time.perf_counter()
    kept, skipped = tokenize_shard(tokenizer, str(source), (0, conversations), sequence,
                                   str(work / "tokenized.parquet"), str(work / "skipped.parquet"))
    stage = time.perf_counter() - began
    texts = []
    for line in source.read_text().splitlines():
        try:
            texts.append(tokenizer.apply_chat_template(normalize_messages(json.loads(line)), tokenize=False))
        except Exception:  # the stage skips what cannot be rendered; the bare tokenizer gets the rest
            continue
    began = time.perf_counter()
    tokenizer(texts, add_special_tokens=False)
    bare = time.perf_counter() - began
    return {"conversations": conversations, "kept": len(kept), "skipped": len(skipped),
            "stage_seconds": stage, "stage_samples_per_second": conversations / stage,
            "bare_texts": len(texts), "bare_seconds": bare, "bare_samples_per_second": len(texts) / bare}


def snakemake(workdir: Path, config: Path, *args: str) -> tuple[float, subprocess.CompletedProcess]:
    """Wall seconds of one real Snakemake run of this repository's workflow in `workdir`."""
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(config), *args]
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return seconds, proc


def measure_planning(work: Path, conversations: int) -> dict:
    """`snakemake -n` with the production config (config/kimi-k2.5.yaml) on `conversations` synthetic
    conversations in shards of 1,000 (many jobs: the DAG is what costs), and on the demo's 23 for the
    fixed cost."""
    work.mkdir(parents=True, exist_ok=True)
    config = REPO / "config" / "kimi-k2.5.yaml"
    source = write_planning_input(work / "conversations.jsonl", conversations)
    seconds, proc = snakemake(work, config, "-n", "--config", f"input={source}", "run=bench-plan", "shard_size=1000")
    small, _ = snakemake(work, config, "-n", "--config", f"input={DEMO}", "run=bench-plan-small", "shard_size=1000")
    jobs = next((line.split()[1] for line in proc.stdout.splitlines() if line.startswith("total")), None)
    return {"conversations": conversations, "seconds": seconds, "jobs": int(jobs) if jobs else None,
            "seconds_for_23": small}


def disk_bytes(*roots: Path) -> int:
    """Bytes on disk under `roots` (allocated blocks), each file once however many hard links it has."""
    seen, total = set(), 0
    for root in roots:
        for directory, _, names in os.walk(root):
            for name in names:
                try:
                    st = os.lstat(os.path.join(directory, name))
                except FileNotFoundError:  # renamed or removed while walking
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


class PeakBytes(threading.Thread):
    """The largest `disk_bytes(root)` seen while it runs, sampled every `interval` seconds (the caller
    adds the end state, which it measures anyway)."""

    def __init__(self, root: Path, interval: float = 1.0):
        super().__init__(daemon=True)
        self.root, self.interval, self.peak = root, interval, 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, disk_bytes(self.root))
            self._done.wait(self.interval)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def footprint(run: Path) -> dict:
    """Where a run's bytes are, each counted once (a hard link is free): the dataset, the store beyond
    the dataset (per-sample files; the packed shards in it are the dataset's files), the trainer exports
    beyond what they share with both, everything."""
    dataset, with_store = disk_bytes(run / "dataset"), disk_bytes(run / "dataset", run / "states")
    return {"dataset_bytes": dataset, "store_bytes": with_store - dataset,
            "exports_own_bytes": disk_bytes(run / "dataset", run / "states", run / "export") - with_store,
            "run_bytes": disk_bytes(run)}


def measure_end_to_end(work: Path, model: str, conversations: int, engine: dict, captures: list[dict],
                       cores: int, shards: int, exports: bool, jobs_per_engine: int = 1,
                       transport_dir: str = "", codec: str = "zstd") -> dict:
    """One whole run (tokenize, extract, validate, pack, report) of demo-like conversations in `shards`
    shards, the model already built: tokens packed per wall second, from the start and from the moment
    the first extract job had its engine ready to the packed dataset, and the engine loads it took (one:
    the node's engine serves every shard). On a GPU `jobs_per_engine` extract jobs run side by side (one
    computes, the others prepare and queue for the engine). `transport_dir`: storage.transport_dir (its
    peak is measured apart: memory, not disk); `codec`: storage.compression.codec. With `exports`, then
    both trainer exports, for the footprint after them."""
    work.mkdir(parents=True, exist_ok=True)
    from eagle3data.model.info import read_model_info

    info = read_model_info(model)
    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    config.update(run="bench-e2e", input=str(write_conversations(work / "conversations.jsonl", conversations)),
                  shard_size=-(-conversations // shards), captures=captures)
    config["model"].update(path=str(Path(model).resolve()), build_demo=False, hidden_size=info.hidden_size,
                           num_hidden_layers=info.num_hidden_layers)
    config["engine"].update(engine)
    config["storage"] = {"drop_packed_states": True, "transport_dir": transport_dir,  # one copy, as Kimi's
                         "compression": {"codec": codec}}
    # The trainers read the packed states in place (exports/speculators_reader.py, exports/specforge_reader.py).
    config["export"] = {"speculators": {"states": "reader"}, "specforge": {"states": "reader"}}
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    run = work / "results" / "bench-e2e"
    peak = PeakBytes(run)
    peak.start()
    transport = Path(transport_dir) / "bench-e2e" if transport_dir else None
    if transport:
        shutil.rmtree(transport, ignore_errors=True)
        transport_peak = PeakBytes(transport)
        transport_peak.start()
    # As a user runs it: --resources gpu=N, here N = the engine's GPUs x jobs_per_engine (README, "The
    # model loads once per node": jobs beyond the GPUs queue for the engine).
    tensor_parallel = EngineSettings.with_defaults(config["engine"], REPO / "config" / "schema.yaml").tensor_parallel_size
    budget = tensor_parallel * jobs_per_engine  # (the demo config leaves the size to the schema's default)
    gpus = ["--resources", f"gpu={budget}"] if engine["device"] == "cuda" else []
    seconds, proc = snakemake(work, work / "config.yaml", "--cores", str(cores), *gpus)
    finished_at = time.time()
    (work / "snakemake.log").write_text(proc.stdout + proc.stderr)  # when each job started and ended
    # The state after a stage is one of the run's states (an engine stopping may still be logging).
    pipeline_peak = max(peak.peak, disk_bytes(run))
    if exports:  # the footprint of a run with the trainer exports (not timed: figure 7 ends at the dataset)
        snakemake(work, work / "config.yaml", "--cores", str(cores), "export_speculators", "export_specforge")
    disk = footprint(run)
    disk["raw_state_bytes"] = json.loads((run / "dataset.counts.json").read_text())["states_bytes"]
    peak_bytes = max(peak.stop(), pipeline_peak, disk["run_bytes"])
    if transport:
        disk["transport_peak_bytes"] = transport_peak.stop()
        disk["transport_left_bytes"] = disk_bytes(transport)
    tokens = int(pc.sum(datasets.load_from_disk(str(run / "dataset")).data.table["seq_len"]).as_py())
    counts = json.loads((run / "dataset.counts.json").read_text())
    rules = {}
    for tsv in sorted((run / "benchmarks").rglob("*.tsv")):
        rules[str(tsv.relative_to(run / "benchmarks"))] = float(pd.read_csv(tsv, sep="\t")["s"].iloc[0])
    stats_files = sorted((run / "extract").glob("*.stats.json"))
    extract = [json.loads(p.read_text()) for p in stats_files]
    loads = [s["engine_load_seconds"] for s in extract if s.get("engine_loaded_here")]
    first_ready = min(s["engine_ready_at"] for s in extract)
    timeline = run_timeline(run, extract, first_ready)
    turns = engine_turns(stats_files, extract, first_ready)
    from_ready = timeline["index_end"]  # the counts file is written once the dataset is
    return {"conversations": conversations, "packed": counts["packed"], "tokens": tokens, "seconds": seconds,
            "tokens_per_second": tokens / seconds, "seconds_from_engine_ready": from_ready,
            "seconds_from_engine_ready_to_end_of_run": finished_at - first_ready, "jobs_per_engine": jobs_per_engine,
            "transport_dir": transport_dir,
            "extract_prepare_seconds": [s.get("prepare_seconds") for s in extract],
            "index_seconds": counts.get("index_seconds"), "engine_turns": turns,
            "tokens_per_second_from_engine_ready": tokens / from_ready, "timeline": timeline,
            "rule_seconds": rules, "cores": cores,
            "shards": len(extract), "engine_loads": len(loads), "engine_load_seconds": sum(loads),
            "footprint": {**disk, "peak_bytes": peak_bytes, "pipeline_peak_bytes": pipeline_peak}}


def engine_turns(stats_files: list[Path], extract: list[dict], first_ready: float) -> list[dict]:
    """Each extract job's turn on the engine (its stats file and what it holds), in the order the engine
    served them: its shard, tokens, when it had the engine (seconds from the first job's) and for how long
    it was in generate(), and when its manifest was written: the engine's rate per shard, and the gaps
    between turns."""
    turns = []
    for path, stats in zip(stats_files, extract):
        shard = path.name.split(".")[0]
        turns.append({"shard": shard, "tokens": stats["computed_tokens"], "served": stats["engine_shards_served"],
                      "ready": stats["engine_ready_at"] - first_ready,
                      "generate_seconds": stats["generate_seconds"] + stats["replies_seconds"],
                      "manifest_written": path.with_name(f"{shard}.parquet").stat().st_mtime - first_ready})
    return sorted(turns, key=lambda turn: turn["ready"])


def run_timeline(run: Path, extract: list[dict], first_ready: float) -> dict:
    """Where figure 7's seconds go, from the engine ready (epoch `first_ready`): when the last job of each
    stage wrote its output (file times, not the Snakemake log's whole seconds), and how long jobs held
    the engine in generate() (the rest of the span up to the last generate's end the engine idled
    between jobs, or while a job prepared its prompts)."""
    def last_written(pattern: str) -> float:
        return max(p.stat().st_mtime for p in run.glob(pattern)) - first_ready

    held = sum(s["generate_seconds"] + s["replies_seconds"] for s in extract)
    last_generate = max(s["engine_ready_at"] + s["generate_seconds"] + s["replies_seconds"] for s in extract)
    return {"last_extract_end": last_written("extract/shard-*.parquet"),
            "last_validate_end": last_written("validated/shard-*.quarantined.parquet"),
            "last_pack_shard_end": last_written("packed/shard-*.json"),
            "index_end": last_written("dataset.counts.json"),
            "last_generate_end": last_generate - first_ready, "engine_held_seconds": held}
