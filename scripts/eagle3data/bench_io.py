"""Benchmark figures 2, 3 and 6: validate, pack and storage on Kimi-sized synthetic samples.

Kimi-K2.5's shape (61 layers, hidden 7168, four captures) is written as config.json only; samples of
`[512, 4, 7168]` random bf16 states are written as the store's files (`store.sample_path`,
`store.atomic_path`, the connector's tensors), one extract manifest per shard. The real `validate` and
`pack` stages then run on them, each beside its reference on the same files: plainly reading them, and
`cp` of them. Pack runs in a child process (`python -m eagle3data.bench_io pack JOB.json`) so that its
peak RSS is its own.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
import yaml
from safetensors.torch import save_file

from eagle3data.pack import PackJob
from eagle3data.schemas import ExtractManifest, SkippedShard, check
from eagle3data.settings import Settings
from eagle3data.shapes import write_shape
from eagle3data.store import atomic_path, sample_path
from eagle3data.synthetic import random_prompts, write_token_shard
from eagle3data.validate import ValidateJob, run as validate_run

REPO = Path(__file__).resolve().parents[2]
READ_CHUNK = 8 << 20


@dataclass
class Shard:
    tokenized: str
    extract_manifest: str
    skipped: str
    states: str  # validate's output: the states manifest pack reads
    quarantined: str
    files: list[str]


def kimi_settings(work: Path) -> Settings:
    """The production config (config/kimi-k2.5.yaml) on a Kimi-K2.5-shaped config.json in `work`."""
    from snakemake.utils import validate

    config = yaml.safe_load((REPO / "config" / "kimi-k2.5.yaml").read_text())
    config["model"]["path"] = str(write_shape("kimi-k2.5", work / "kimi-shape"))
    validate(config, str(REPO / "config" / "schema.yaml"), set_default=True)
    return Settings(config)


def write_shards(settings: Settings, work: Path, shards: int, samples: int, tokens: int) -> list[Shard]:
    """`shards` shards of `samples` random samples of `tokens` tokens, as tokenize and extract leave them."""
    expected = settings.expected
    store = work / "store"
    out = []
    for i in range(shards):
        prompts = random_prompts(samples, tokens, settings.model.vocab_size, seed=i)
        shard = Shard(*(str(work / f"shard-{i:05d}{suffix}") for suffix in (
            ".parquet", ".extract.parquet", ".skipped.parquet", ".states.parquet", ".quarantined.parquet")),
            files=[])
        write_token_shard(shard.tokenized, prompts)
        rows = []
        for sid, ids in prompts.items():
            path = sample_path(store, sid)
            states = torch.randn(len(ids), len(expected.captures), expected.hidden_size).to(torch.bfloat16)
            with atomic_path(path) as tmp:
                save_file({"hidden_states": states, "token_ids": torch.tensor(ids, dtype=torch.int64)}, tmp)
            rows.append((sid, len(ids), str(path), "computed"))
            shard.files.append(str(path))
        manifest = check(ExtractManifest, pd.DataFrame(rows, columns=["sample_id", "num_tokens", "path", "status"]),
                         shard.extract_manifest)
        manifest.to_parquet(shard.extract_manifest, index=False)
        skipped = pd.DataFrame({"sample_id": [], "source_row": [], "source_id": [], "reason": []})
        check(SkippedShard, skipped, shard.skipped).to_parquet(shard.skipped, index=False)
        out.append(shard)
    return out


def file_bytes(shards: list[Shard]) -> int:
    return sum(Path(f).stat().st_size for s in shards for f in s.files)


def read_files(shards: list[Shard]) -> float:
    """Seconds to read every states file into one reused buffer (the reference for validate)."""
    buffer = memoryview(bytearray(READ_CHUNK))
    began = time.perf_counter()
    for shard in shards:
        for path in shard.files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
    return time.perf_counter() - began


def validate_shards(settings: Settings, shards: list[Shard]) -> float:
    """Seconds of the validate stage over every shard (writes each shard's states manifest)."""
    began = time.perf_counter()
    for shard in shards:
        validate_run(ValidateJob(shard.tokenized, shard.extract_manifest, shard.states, shard.quarantined,
                                 shard.tokenized + ".quarantine", settings.expected, settings.model.vocab_size,
                                 settings.config["sequence"]))
    return time.perf_counter() - began


def copy_files(shards: list[Shard], dest: Path) -> float:
    """Seconds of one `cp` of every states file of `shards` into `dest` (removed afterwards)."""
    dest.mkdir(parents=True, exist_ok=True)
    files = [f for s in shards for f in s.files]
    began = time.perf_counter()
    subprocess.run(["cp", "--target-directory", str(dest), *files], check=True)
    seconds = time.perf_counter() - began
    shutil.rmtree(dest)
    return seconds


def pack_in_child(settings: Settings, shards: list[Shard], out_dir: Path) -> dict:
    """Pack `shards` into `out_dir` in a fresh process: its seconds, bytes and peak RSS."""
    job = PackJob([s.tokenized for s in shards], [s.skipped for s in shards], [s.states for s in shards],
                  [s.quarantined for s in shards], str(out_dir), str(out_dir) + ".counts.json",
                  sum(len(s.files) for s in shards), settings.dataset_metadata())
    job_file = out_dir.with_suffix(".job.json")
    job_file.write_text(json.dumps(asdict(job)))
    proc = subprocess.run([sys.executable, "-m", "eagle3data.bench_io", "pack", str(job_file)],
                          stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def dataset_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _pack_child(job_file: str) -> None:
    """Child process: run pack; print its seconds, the RSS before it and the process's peak RSS."""
    from eagle3data.pack import run

    job = PackJob(**json.loads(Path(job_file).read_text()))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    counts = run(job)
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "packed": counts["packed"], "rss_before_mib": before / 1024,
                      "peak_rss_mib": peak / 1024}))


if __name__ == "__main__":
    if sys.argv[1:2] != ["pack"] or len(sys.argv) != 3:
        sys.exit("usage: python -m eagle3data.bench_io pack JOB.json")
    _pack_child(sys.argv[2])
