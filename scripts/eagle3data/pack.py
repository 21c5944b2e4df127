"""The `pack` stage: validated shards into one Hugging Face Arrow dataset, streamed shard by shard.

Memory is bounded by one batch of samples: each shard becomes one `data-*.arrow` file written batch by
batch with `datasets`' ArrowWriter, then the dataset's state and info files are written, and the whole
directory is renamed into place, so a crash never leaves a dataset that looks complete. Counts are
reconciled before anything is published: conversations in = packed + skipped.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import pandas as pd
from datasets.arrow_writer import ArrowWriter
from safetensors import safe_open
from tqdm import tqdm

from eagle3data import dataset as fmt
from eagle3data.logs import get_logger
from eagle3data.schemas import SkippedShard, StatesManifest, TokenizedShard, check
from eagle3data.store import atomic_path, atomic_write_text

logger = get_logger(__name__)


class ReconciliationError(RuntimeError):
    pass


@dataclass
class PackJob:
    tokenized: list[str]
    skipped: list[str]
    states: list[str]
    out_dir: str
    counts_out: str
    conversations_in: int
    metadata: dict
    batch_size: int = 32


def _load_states(path: str) -> "torch.Tensor":
    with safe_open(path, framework="pt") as f:
        return f.get_tensor("hidden_states")


def _shard_batches(tokenized: pd.DataFrame, manifest: pd.DataFrame, seen: set, dup_rows: list,
                   batch_size: int, dtype: str):
    paths = manifest.drop_duplicates("sample_id").set_index("sample_id")["path"]
    rows = []
    for row in tokenized.itertuples(index=False):
        if row.sample_id in seen:
            dup_rows.append({"sample_id": row.sample_id, "source_row": row.source_row,
                             "source_id": row.source_id, "reason": "duplicate_conversation"})
            continue
        seen.add(row.sample_id)
        rows.append(row)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        states = [_load_states(paths[r.sample_id]) for r in chunk]
        yield {
            "sample_id": [r.sample_id for r in chunk],
            "input_ids": [list(map(int, r.input_ids)) for r in chunk],
            "loss_mask": [list(map(int, r.loss_mask)) for r in chunk],
            "seq_len": [int(r.num_tokens) for r in chunk],
        }, fmt.states_array(states, dtype)


def run(job: PackJob) -> dict:
    meta = job.metadata
    features = fmt.features(len(meta["captures"]), meta["hidden_size"], meta["dtype"])
    out = Path(job.out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    seen: set[str] = set()
    dup_rows: list[dict] = []
    skipped = [check(SkippedShard, pd.read_parquet(p), p) for p in job.skipped]
    began, nbytes, packed = time.perf_counter(), 0, 0
    n = len(job.tokenized)
    for i, (tok_path, states_path) in enumerate(tqdm(list(zip(job.tokenized, job.states)),
                                                      desc="pack", unit="shard")):
        tokenized = check(TokenizedShard, pd.read_parquet(tok_path), tok_path)
        manifest = check(StatesManifest, pd.read_parquet(states_path), states_path)
        missing = set(tokenized["sample_id"]) - set(manifest["sample_id"])
        if missing:
            raise ReconciliationError(
                f"{states_path}: {len(missing)} tokenized sample(s) have no validated states, "
                f"e.g. {sorted(missing)[:3]}"
            )
        writer = ArrowWriter(features=features, path=str(tmp / f"data-{i:05d}-of-{n:05d}.arrow"))
        for columns, states in _shard_batches(tokenized, manifest, seen, dup_rows, job.batch_size,
                                              meta["dtype"]):
            batch = _record_batch(columns, states, features)
            writer.write_table(batch)
            packed += batch.num_rows
            nbytes += batch.nbytes
        writer.finalize()
        writer.close()
    counts = _reconcile(job.conversations_in, packed, skipped + [pd.DataFrame(dup_rows, columns=[
        "sample_id", "source_row", "source_id", "reason"])])
    meta = {**meta, "format_version": fmt.FORMAT_VERSION, "counts": counts}
    _write_dataset_files(tmp, n, features, meta)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    seconds = time.perf_counter() - began
    counts_doc = {**counts, "pack_seconds": seconds, "pack_bytes": nbytes}
    atomic_write_text(job.counts_out, json.dumps(counts_doc, indent=2))
    logger.info("packed %d samples (%.1f MB) into %s", packed, nbytes / 1e6, out)
    return counts_doc


def _record_batch(columns: dict, states, features: datasets.Features):
    import pyarrow as pa

    schema = features.arrow_schema
    arrays = [pa.array(columns[name], type=schema.field(name).type) for name in fmt.COLUMNS[:-1]]
    arrays.append(states)
    return pa.Table.from_arrays(arrays, schema=schema)


def _reconcile(conversations_in: int, packed: int, skipped_frames: list[pd.DataFrame]) -> dict:
    skipped = pd.concat(skipped_frames, ignore_index=True)
    reasons = skipped["reason"].str.split(":").str[0].value_counts().to_dict()
    if packed + len(skipped) != conversations_in:
        raise ReconciliationError(
            f"counts do not reconcile: {conversations_in} conversations in, {packed} packed + "
            f"{len(skipped)} skipped = {packed + len(skipped)}"
        )
    return {
        "conversations_in": conversations_in,
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
