"""Rule pack: the dataset as an index over the packed shards (pack.py packs each shard beside extraction).

The shards' Arrow files are hard-linked into the dataset directory (no bytes copied; copied only where
the filesystem cannot link), the counts reconciled (conversations in = packed + skipped, quarantined
samples and duplicates included; a conversation that tokenize split into several samples adds each
sample after its first), `load_from_disk`'s state and info files and the card written, the whole checked
as `check_dataset` sees it, then renamed into place: a crash never leaves a dataset that looks complete.
It handles no tensor, and imports no torch: this job is the last of a run, and on a GPU node torch
alone took ~5 s to import.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import pandas as pd

from eagle3data.dataset import format as fmt
from eagle3data.dataset.card import write_card
from eagle3data.dataset.check import check_dataset
from eagle3data.utils.logs import get_logger
from eagle3data.dataset.packed import remove_orphans
from eagle3data.contracts.schemas import SkippedShard, check
from eagle3data.storage.store import Store, atomic_path, atomic_write_text

logger = get_logger(__name__)


class ReconciliationError(RuntimeError):
    pass


@dataclass
class IndexJob:
    summaries: list[str]  # each names its shard's packed file
    skipped: list[str]
    quarantined: list[str]
    out_dir: str
    counts_out: str
    conversations_in: int
    metadata: dict
    store: Store | None = None  # the run's: its packed shards that no summary names go (packed.remove_orphans)


def index(job: IndexJob) -> dict:
    """The dataset over the packed shards: their files hard-linked (no bytes copied; copied only where
    the filesystem cannot link), the counts reconciled, state, info and card written, the whole checked,
    then renamed into place."""
    began = time.perf_counter()
    out, n = Path(job.out_dir), len(job.summaries)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    summaries = [json.loads(Path(p).read_text()) for p in job.summaries]
    for i, summary in enumerate(summaries):
        _link_or_copy(Path(summary["arrow"]), tmp / f"data-{i:05d}-of-{n:05d}.arrow")
    if job.store is not None:
        remove_orphans(job.store, [s["arrow"] for s in summaries])
    skipped = [check(SkippedShard, pd.read_parquet(p), p) for p in [*job.skipped, *job.quarantined]]
    duplicates = pd.DataFrame([d for s in summaries for d in s["duplicates"]],
                              columns=["sample_id", "source_row", "source_id", "reason"])
    counts = _reconcile(job.conversations_in, sum(s["split_samples"] for s in summaries),
                        sum(s["packed"] for s in summaries), skipped + [duplicates])
    _refuse_unchecksummed([Path(s["arrow"]) for s in summaries])
    meta = {**job.metadata, "format_version": fmt.FORMAT_VERSION, "checksums": fmt.CHECKSUMS, "counts": counts}
    features = fmt.meta_features(meta)
    _write_dataset_files(tmp, n, features, meta)
    write_card(tmp, meta)
    check_dataset(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    nbytes = sum(s["pack_bytes"] for s in summaries)
    counts_doc = {**counts, "pack_seconds": sum(s["pack_seconds"] for s in summaries), "pack_bytes": nbytes,
                  "states_bytes": sum(s.get("states_bytes", 0) for s in summaries),
                  "index_seconds": time.perf_counter() - began, "parity": job.metadata.get("parity")}
    atomic_write_text(job.counts_out, json.dumps(counts_doc, indent=2))
    logger.info("dataset %s: %d samples (%.1f MB) in %d packed shards", out, counts["packed"], nbytes / 1e6, n)
    return counts_doc


def _refuse_unchecksummed(shards: list[Path]) -> None:
    """Every packed shard carries its rows' checksums (format.py): one packed before they were added
    must be packed again before it joins a dataset."""
    import pyarrow as pa

    wanted = {fmt.STATES_CRC, fmt.STORED_CRC, fmt.TOKENS_CRC}
    old = [str(p) for p in shards if wanted - set(pa.ipc.open_stream(pa.memory_map(str(p))).schema.names)]
    if old:
        raise ReconciliationError(
            f"packed shards without checksum columns ({', '.join(sorted(wanted))}), packed by an older "
            f"eagle3data: {', '.join(old)}. Pack them again: snakemake --forcerun pack_shard")


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as exc:  # another filesystem, or one without hard links
        logger.warning("cannot hard-link %s (%s): copying it", source, exc)
        shutil.copy2(source, target)


def _reconcile(conversations_in: int, split: int, packed: int, skipped_frames: list[pd.DataFrame]) -> dict:
    skipped = pd.concat(skipped_frames, ignore_index=True)
    reasons = skipped["reason"].str.split(":").str[0].value_counts().to_dict()
    if packed + len(skipped) != conversations_in + split:
        raise ReconciliationError(
            f"counts do not reconcile: {conversations_in} conversations in + {split} samples split from "
            f"them, {packed} packed + {len(skipped)} skipped = {packed + len(skipped)}"
        )
    return {
        "conversations_in": conversations_in,
        "split_samples": split,
        "packed": packed,
        "skipped": len(skipped),
        "skip_reasons": {k: int(v) for k, v in reasons.items()},
    }


def _write_dataset_files(directory: Path, n_shards: int, features, meta: dict) -> None:
    """`load_from_disk`'s state and info files, plus our metadata (also in the info's description)."""
    state = {
        "_data_files": [{"filename": f"data-{i:05d}-of-{n_shards:05d}.arrow"} for i in range(n_shards)],
        "_fingerprint": meta["fingerprint"],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }
    (directory / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    info = datasets.DatasetInfo(
        description="EAGLE-3 training data: " + json.dumps(meta), features=features
    )
    info.write_to_directory(str(directory))
    with atomic_path(directory / fmt.METADATA_FILE) as tmp:
        Path(tmp).write_text(json.dumps(meta, indent=2))
