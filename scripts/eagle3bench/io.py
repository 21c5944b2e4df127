"""Benchmark figures 2, 3 and 3m: validate and pack on Kimi-sized synthetic samples (and their storage
ratio, printed in figure 6's line).

Kimi-K2.5's shape (61 layers, hidden 7168, the four captures of config/kimi-k2.5.yaml) is written as
config.json only; samples of `[512, 4, 7168]` random bf16 states are written as the store's files
(`store.sample_path`, `store.atomic_path`, the connector's tensors and the validation facts it writes in
the header) with a tokenized shard and an extract manifest per shard. The real `validate` and `pack` stages then run on them as Snakemake runs them: in
their own process with OMP_NUM_THREADS set to the rule's `threads` (validate 2; pack_shard
storage.compression.threads, capped by the cores as Snakemake caps it), timed inside it
(`python -m eagle3bench.io validate|pack JOB.json`), beside their references on the same files:
plainly reading them, and `cp` of them. Two sets of raw files, as the connector writes them: one validated
and packed into a zstd dataset (pack compresses), one packed without compression, in the same passes; rates are of the states' raw bytes. Before each timed pass the files are dropped from the page cache
(posix_fadvise DONTNEED), so every pass reads them from disk, as a production shard (tens of GB) is
read; `os.sync()` first, so no pass pays for an earlier one's writes.
"""

from __future__ import annotations

import json
import os
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

from eagle3data.utils.checkout import REPO
from eagle3data.contracts.schemas import ExtractManifest, SkippedShard, check
from eagle3data.config.settings import Settings
from eagle3data.contracts.measuring import facts_header, save_states
from eagle3data.model.shapes import write_shape
from eagle3data.storage.store import atomic_path, sample_path
from eagle3bench.files import drop_from_page_cache, read_files
from eagle3bench.synthetic import random_prompts, write_token_shard


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
    out = []
    for i in range(shards):
        prompts = random_prompts(samples, tokens, settings.model.vocab_size, seed=i)
        shard = Shard(*(str(work / f"shard-{i:05d}{suffix}") for suffix in (
            ".parquet", ".extract.parquet", ".skipped.parquet", ".states.parquet", ".quarantined.parquet")),
            files=[])
        write_token_shard(shard.tokenized, prompts)
        rows = []
        for sid, ids in prompts.items():
            path = sample_path(work / "store", sid)
            states = torch.randn(len(ids), len(expected.captures), expected.hidden_size).to(torch.bfloat16)
            with atomic_path(path) as tmp:  # as the connector writes them
                save_states(tmp, states, torch.tensor(ids, dtype=torch.int64), facts_header(states))
            rows.append((sid, len(ids), str(path), "computed"))
            shard.files.append(str(path))
        manifest = pd.DataFrame(rows, columns=["sample_id", "num_tokens", "path", "status"])
        check(ExtractManifest, manifest, shard.extract_manifest).to_parquet(shard.extract_manifest, index=False)
        skipped = pd.DataFrame({"sample_id": [], "source_row": [], "source_id": [], "reason": []})
        check(SkippedShard, skipped, shard.skipped).to_parquet(shard.skipped, index=False)
        out.append(shard)
    return out


def one_shard(shards: list[Shard], work: Path) -> Shard:
    """The same samples as one shard (its rows numbered as one input's): production shards hold 1,000
    samples, so validate's and pack's per-shard table checks (~0.3 s a shard) weigh on it as little as
    that, where on 16-sample shards they would weigh as much as the bytes."""
    shard = Shard(*(str(work / f"all{suffix}") for suffix in (
        ".parquet", ".extract.parquet", ".skipped.parquet", ".states.parquet", ".quarantined.parquet")),
        files=files_of(shards))
    for field in ("tokenized", "extract_manifest", "skipped"):
        frame = pd.concat([pd.read_parquet(getattr(s, field)) for s in shards], ignore_index=True)
        if field == "tokenized":
            frame["source_row"] = range(len(frame))
        frame.to_parquet(getattr(shard, field), index=False)
    return shard


def files_of(shards: list[Shard]) -> list[str]:
    return [f for s in shards for f in s.files]


def file_bytes(shards: list[Shard]) -> int:
    return sum(Path(f).stat().st_size for f in files_of(shards))


def copy_files(paths: list[str], dest: Path) -> tuple[float, float]:
    """Seconds of one `cp` of the files into `dest` (removed afterwards), and of it with the copies then
    made durable (`sync` of those files): the reference for pack, which fsyncs the file it writes. `cp`
    alone measures the page cache while the copies fit in dirty memory (1.9 GB here, against 2.5 GB/s
    for `dd` without a sync and 0.38 GB/s with one), so it swung figure 3 between 0.2 and 0.8 with the
    disk's writeback state while pack's rate held."""
    dest.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    subprocess.run(["cp", "--target-directory", str(dest), *paths], check=True)
    copied = time.perf_counter() - began
    subprocess.run(["sync", *(str(dest / Path(p).name) for p in paths)], check=True)
    durable = time.perf_counter() - began
    shutil.rmtree(dest)
    return copied, durable


def pack_threads(settings: Settings) -> int:
    """Rule pack_shard's threads as Snakemake gives them on this machine (capped by the cores)."""
    return min(settings.config["storage"]["compression"]["threads"], os.cpu_count() or 1)


def stage_in_child(stage: str, settings: Settings, shards: list[Shard], out_dir: Path,
                   read_states: bool = False, codec: str = "") -> dict:
    """Run `validate` (each shard; `read_states` as validation.read_states) or `pack` (all shards into
    out_dir; `codec` instead of the config's storage.compression.codec) in a fresh process with the rule's
    threads (validate: `validation.threads`, pack: `pack_threads`), as Snakemake runs it: seconds, peak RSS."""
    threads = settings.config["validation"]["threads"] if stage == "validate" else pack_threads(settings)
    config = json.loads(json.dumps(settings.config))
    if codec:
        config["storage"]["compression"]["codec"] = codec
    job = out_dir.with_suffix(f".{stage}.json")
    job.write_text(json.dumps({"config": config, "shards": [asdict(s) for s in shards],
                               "out_dir": str(out_dir), "read_states": read_states, "threads": threads}))
    # Started through `timeout`, which forks it: a process exec'd straight from this one would count
    # this one's memory in its ru_maxrss (Linux keeps the high-water mark across exec).
    proc = subprocess.run(["timeout", "3600", sys.executable, "-m", "eagle3bench.io", stage, str(job)],
                          check=True, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def open_dataset_rate(dataset: Path, repeats: int) -> float:
    """Raw state bytes a second that `open_dataset` gives back from `dataset`'s rows, warm (figure 12's
    protocol on Kimi-shaped rows, `storage.as_data_loader`); the best of `repeats` passes."""
    from eagle3bench.storage import as_data_loader
    from eagle3data.dataset.format import open_dataset

    ds = open_dataset(dataset)
    raw = sum(ds[i]["hidden_states"].nbytes for i in range(len(ds)))
    with as_data_loader() as read_rows:
        return raw / min(read_rows(ds.__getitem__, len(ds)) for _ in range(repeats))


def dataset_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(work: Path, shards: int, samples: int, tokens: int, repeats: int) -> dict:
    """Figures 2, 3 and 6 on 4 x `shards` shards of `samples` samples of `tokens` tokens, which validate
    and pack see as one shard (pack's 1x for its memory is the first `shards` of them): raw files as the
    connector writes them, packed compressed with zstd, and another set packed without compression. Subject and reference alternate; each keeps its best of `repeats`."""
    settings = kimi_settings(work)
    sets = {"zstd": write_shards(settings, work / "zstd", 4 * shards, samples, tokens),
            "none": write_shards(settings, work / "none", 4 * shards, samples, tokens)}
    files = {codec: files_of(data) for codec, data in sets.items()}
    nbytes = {codec: file_bytes(data) for codec, data in sets.items()}
    whole = {codec: one_shard(data, work / codec) for codec, data in sets.items()}
    for codec, data in sets.items():  # pack's inputs: shard by shard (pack 1x), as one (the timed passes)
        stage_in_child("validate", settings, data, work / f"validated-{codec}")
        stage_in_child("validate", settings, [whole[codec]], work / f"validated-{codec}-whole")
    timings = {"read": [], "validate": [], "validate_measuring": [], "cp": [], "cp_durable": [], "pack": [],
               "cp_durable_raw": [], "pack_raw": []}
    zstd, none = files["zstd"], files["none"]
    for _ in range(repeats):
        drop_from_page_cache(zstd)
        timings["read"].append(read_files(zstd))
        drop_from_page_cache(zstd)
        timings["validate"].append(stage_in_child("validate", settings, [whole["zstd"]], work / "validated")["seconds"])
        drop_from_page_cache(zstd)
        timings["validate_measuring"].append(stage_in_child(
            "validate", settings, [whole["zstd"]], work / "validated", read_states=True)["seconds"])
        drop_from_page_cache(zstd)
        copied, durable = copy_files(zstd, work / "copy")
        timings["cp"].append(copied)
        timings["cp_durable"].append(durable)
        drop_from_page_cache(zstd)
        shutil.rmtree(work / "dataset-4x", ignore_errors=True)
        pack_4x = stage_in_child("pack", settings, [whole["zstd"]], work / "dataset-4x", codec="zstd")
        timings["pack"].append(pack_4x["seconds"])
        drop_from_page_cache(none)
        timings["cp_durable_raw"].append(copy_files(none, work / "copy")[1])
        drop_from_page_cache(none)
        shutil.rmtree(work / "dataset-raw", ignore_errors=True)
        timings["pack_raw"].append(
            stage_in_child("pack", settings, [whole["none"]], work / "dataset-raw", codec="none")["seconds"])
    warm_read = read_files(zstd)
    warm_validate = stage_in_child("validate", settings, [whole["zstd"]], work / "validated", read_states=True)["seconds"]
    pack_1x = stage_in_child("pack", settings, sets["zstd"][:shards], work / "dataset-1x", codec="zstd")
    best = {k: min(v) for k, v in timings.items()}
    packed_tokens = 4 * shards * samples * tokens
    raw_per_token = len(settings.expected.captures) * settings.expected.hidden_size * 2
    raw = packed_tokens * raw_per_token  # the states' bytes: rates are of these, whatever the files hold
    return {
        "shape": {"captures": len(settings.expected.captures), "hidden_size": settings.expected.hidden_size,
                  "tokens_per_sample": tokens, "samples_per_shard": samples, "shards_1x": shards,
                  "shards_4x": 4 * shards, "files": len(zstd), "bytes": nbytes["zstd"], "raw_bytes": raw,
                  "raw_file_bytes": nbytes["none"]},
        "seconds": timings,
        "validate_bytes_per_second": raw / best["validate"], "read_bytes_per_second": raw / best["read"],
        "validate_measuring_bytes_per_second": raw / best["validate_measuring"],
        "warm": {"validate_measuring_bytes_per_second": raw / warm_validate,
                 "read_bytes_per_second": raw / warm_read},
        "pack_bytes_per_second": raw / best["pack"], "cp_bytes_per_second": raw / best["cp"],
        "pack_raw_bytes_per_second": raw / best["pack_raw"], "pack_threads": pack_threads(settings),
        "cp_durable_raw_bytes_per_second": raw / best["cp_durable_raw"],
        "compression": "zstd",
        "dataset_raw_bytes": dataset_bytes(work / "dataset-raw"),
        "cp_durable_bytes_per_second": raw / best["cp_durable"],
        "pack_peak_rss_mib": {"1x": pack_1x["peak_rss_mib"], "4x": pack_4x["peak_rss_mib"],
                              "before_pack": pack_1x["rss_before_mib"]},
        "dataset_bytes": dataset_bytes(work / "dataset-4x"), "packed_tokens": packed_tokens,
        "dataset_bytes_per_token": dataset_bytes(work / "dataset-4x") / packed_tokens,
        "raw_state_bytes_per_token": raw_per_token,
        "open_dataset_rates": {"compressed": open_dataset_rate(work / "dataset-4x", repeats),
                               "raw": open_dataset_rate(work / "dataset-raw", repeats)},
    }


def _child(stage: str, job_file: str) -> None:
    """Child process: run the stage; print its seconds, the RSS before it and the process's peak RSS."""
    from eagle3data.dataset.pack import PackJob, run as pack
    from eagle3data.validate.stage import ValidateJob, run as validate

    job = json.loads(Path(job_file).read_text())
    settings, shards = Settings(job["config"]), [Shard(**s) for s in job["shards"]]
    expected, vocab, sequence = settings.expected, settings.model.vocab_size, settings.config["sequence"]
    metadata = settings.dataset_metadata()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    if stage == "validate":
        for s in shards:
            validate(ValidateJob(s.tokenized, s.extract_manifest, s.states, s.quarantined, s.tokenized + ".q",
                                 expected, vocab, sequence, threads=settings.config["validation"]["threads"],
                                 read_states=job["read_states"]))
    else:
        out = job["out_dir"]
        pack(PackJob([s.tokenized for s in shards], [s.skipped for s in shards], [s.states for s in shards],
                     [s.quarantined for s in shards], out, out + ".counts.json",
                     sum(len(s.files) for s in shards), metadata, threads=job["threads"]))
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "rss_before_mib": before / 1024, "peak_rss_mib": peak / 1024}))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("validate", "pack"):
        sys.exit("usage: python -m eagle3bench.io validate|pack JOB.json")
    _child(*sys.argv[1:])
