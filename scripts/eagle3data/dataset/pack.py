"""The `pack` stage: each validated shard into one Arrow file as soon as it is validated (rule
pack_shard), then the Hugging Face dataset as an index over them (rule pack: index.py).

Rule pack_shard streams a shard's states into `states/<key>/packed/shard-NNNNN.arrow` (packed.py says why
there) with `datasets`' ArrowWriter (memory: one batch of samples), while the engine extracts later shards,
and under `storage.drop_packed_states` then has the store drop the files it packed; rule pack then only
hard-links those files into the dataset directory, writes its state and info files and renames it into place,
so the last step after extraction costs seconds, the dataset costs no bytes beside the packed files, and a
crash never leaves a dataset that looks complete. A shard packed again replaces its file under the same name:
an earlier dataset keeps linking the file it indexed, whole, until rule pack replaces that dataset (a run
stopped before then runs pack next time). Every boundary is checked again: each shard's tables against
their contracts, each states file against the checksums validate recorded (a file changed since is refused),
the counts (conversations in = packed + skipped, quarantined samples included; a conversation that tokenize
split into several samples adds each sample after its first to the samples in: `split_samples`), and the
finished dataset as `check_dataset` sees it. A conversation already packed by an earlier shard is recorded as
a duplicate (duplicates.py: one table for the run, written after tokenize).

Under `storage.compression.codec: zstd` (storage/compression.py) each raw store file (as the engine
writes them) is compressed by the thread that read it, and its frame checked by decompressing it against
the CRCs validate recorded. A file an earlier version's writer threads compressed keeps its frame, checked
by the CRC of its bytes and the raw values' CRCs its header states (`_verified_states`). Under
`storage.compression.precision: fp8_e4m3` (storage/fp8.py) the frame holds e4m3 codes: it is decoded, its
values refused unless each keeps the stated error bound against the validated values, and the row's
`hidden_states_crc32` are the CRCs of those decoded values, which every reader returns and verifies.

Each row carries those CRCs (`hidden_states_crc32`, per capture), one of its stored states (the frame, or
the raw values) and of those (`hidden_states_stored_crc32`), and one of its sample id, token ids, mask and
length (`tokens_crc32`), which every reader verifies (format.py).
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from datasets.arrow_writer import ArrowWriter

from eagle3data.dataset import format as fmt
from eagle3data.storage import fp8
from eagle3data.storage.compression import Compression, capture_crcs, decode, frame_checksum
from eagle3data.dataset.duplicates import packed_earlier, write_index
from eagle3data.contracts.failures import BoundaryError, Failure, show, summary, validate
from eagle3data.dataset.index import IndexJob, index
from eagle3data.utils.logs import get_logger
from eagle3data.utils.overlap import ahead
from eagle3data.dataset.packed import held_elsewhere
from eagle3data.contracts.schemas import (
    ManifestEntry,
    SkippedShard,
    TokenizedShard,
    check,
    entries_by_sample,
    sample_states,
)
from eagle3data.contracts.states import Expected
from eagle3data.contracts.reading import STORAGE, checksum, read_states
from eagle3data.storage.room import DiskSpaceError
from eagle3data.storage.store import Store, atomic_path, atomic_write_text, start_writeback
from eagle3data.utils import faults

logger = get_logger(__name__)
# A batch holds at most PackJob.batch_size samples and about this many bytes of states (one Kimi-K2.5
# sample is 29 MB): two batches are in memory at a time, one written while the next is read.
BATCH_BYTES = 64 << 20
# A batch's samples are read and checked this many at a time: from disk one reader waits on each read
# (2 readers: 1.2 GB/s cold on this machine's disk, 1 reader 0.87), from a RAM disk the CRCs bound it.
# With compression, as many as the job's threads (each compresses what it read).
READERS = 2


@dataclass
class PackJob:
    """Every shard at once (the benchmarks and tests): each packed as pack_shard does, then indexed."""
    tokenized: list[str]
    skipped: list[str]
    states: list[str]
    quarantined: list[str]
    out_dir: str
    counts_out: str
    conversations_in: int
    metadata: dict
    batch_size: int = 32
    store: Store | None = None  # the run's store (its room settings, its dropped files); None: the schema's settings
    threads: int = 1


@dataclass
class ShardPackJob:
    tokenized: str
    skipped: str
    states: str
    quarantined: str
    duplicates: str  # duplicates.write_index of the run's shards: what earlier shards pack is not packed again
    shard: int  # this shard's position among them
    arrow: str
    summary: str
    metadata: dict
    store: Store  # the run's: dropped files come back from it, and go once packed (storage.drop_packed_states)
    dataset: str = ""  # rule pack's dataset: until pack replaces it, its links hold the shard packed before
    batch_size: int = 32
    threads: int = 1  # the rule's: samples read, checked and compressed at once


def _verified_states(sample_id: str, captures: list[ManifestEntry], out: np.ndarray,
                     compression: Compression | None = None) -> tuple[bytes | bytearray | None, list[int]]:
    """Read the sample's states into `out`, refused unless every capture's checksum is the one validate
    recorded; return the frame to store (with `compression`, else None) and the row's `hidden_states_crc32`.
    A file the engine compressed as `compression` compresses is not decompressed: its frame is stored as it
    is, refused unless its bytes have the CRC its header states and the header states the validated
    checksums (its writer proved the frame gives back the values those are of). Any other file is read (a
    compressed one decompressed) and its values checked; a frame made here is refused unless it
    decompresses to the same checksums, or (fp8) to values within the stated error bound of them, whose
    CRCs the row then carries."""
    path, expected = captures[0].path, [c.checksum for c in captures]
    stored = None
    try:
        _, _, stored = read_states(path, out, keep=compression)
        if stored is None or stored.decoded:
            found = [checksum(out[:, c.slot, :]) for c in captures]
        elif frame_checksum(stored.frame) != stored.checksum:
            found = f"a frame whose CRC {frame_checksum(stored.frame)} is not the {stored.checksum} its header states"
        else:
            found = [stored.capture_checksums[c.slot] for c in captures] if stored.capture_checksums else "none"
    except Exception as exc:  # gone, truncated, reshaped since validate
        found = f"{type(exc).__name__}: {exc}"
    if found != expected:
        failure = Failure(sample_id, "checksums == validated checksums", show(expected), show(found), path)
        raise BoundaryError(
            f"{failure}\nThe file changed after validate; re-check it: snakemake --forcerun validate"
        )
    crcs = [int(c, 16) for c in expected]
    if compression is None:
        return None, crcs
    if stored is not None and not stored.decoded:
        return stored.frame, crcs
    frame = compression.encode(out)
    stored = decode(frame, out.shape[1], out.shape[2], out.dtype, threads=compression.threads)
    if compression.lossy:
        excess = fp8.error_to_bound(out, stored)
        if excess <= 1:
            return frame, capture_crcs(stored)
        failure = Failure(sample_id, f"{compression.precision} values read back within the stated error bound",
                          "<= 1 x the bound", f"{excess:.3f} x the bound", path)
        instead = "storage.compression.precision: exact"
    else:
        found = [checksum(stored[:, c.slot, :]) for c in captures]
        if found == expected:
            return frame, crcs
        failure = Failure(sample_id, "checksums of the compressed states == validated checksums", show(expected),
                          show(found), path)
        instead = "storage.compression.codec: none"
    # a fault of the codec or the memory, never of the file
    raise BoundaryError(f"{failure}\nCompression did not give the states back (storage/compression.py); "
                        f"pack again, or set {instead}")


def _checked_shard(tok_path: str, states_path: str, quarantined_path: str,
                   expected: Expected) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A shard's tables as validate left them, all checked before failing: (the tokenized samples to
    pack, their states manifest, the quarantined samples)."""
    tokenized, found = validate(TokenizedShard, pd.read_parquet(tok_path), tok_path)
    quarantined, bad = validate(SkippedShard, pd.read_parquet(quarantined_path), quarantined_path)
    found += bad
    manifest, bad = validate(expected.manifest_contract(), pd.read_parquet(states_path), states_path)
    found += bad
    tokenized = tokenized[~tokenized["sample_id"].isin(quarantined["sample_id"])]
    if not any(f.sample_id == "-" for f in found):  # every table has its columns
        found += validate(expected.samples_contract(), sample_states(manifest, tokenized), states_path)[1]
    if found:
        files = [tok_path, states_path, quarantined_path]
        raise BoundaryError(summary(f"pack: shard {tok_path} is not what validate left", found,
                                    len(tokenized) + len(quarantined), files))
    return tokenized, manifest, quarantined


def _chunks(rows: list, max_rows: int, max_tokens: int):
    """Consecutive runs of rows, each at most `max_rows` rows and `max_tokens` tokens (or one row)."""
    chunk, tokens = [], 0
    for row in rows:
        if chunk and (len(chunk) == max_rows or tokens + row.num_tokens > max_tokens):
            yield chunk
            chunk, tokens = [], 0
        chunk.append(row)
        tokens += int(row.num_tokens)
    if chunk:
        yield chunk


def _shard_batches(tokenized: pd.DataFrame, manifest: pd.DataFrame, seen: set, dup_rows: list,
                   batch_size: int, expected: Expected, readers: ThreadPoolExecutor, compression: Compression | None):
    captures = entries_by_sample(manifest)
    rows = []
    for row in tokenized.itertuples(index=False):
        if row.sample_id in seen:
            dup_rows.append({"sample_id": row.sample_id, "source_row": row.source_row,
                             "source_id": row.source_id, "reason": "duplicate_conversation"})
            continue
        seen.add(row.sample_id)
        rows.append(row)
    storage = STORAGE[expected.dtype]
    for chunk in _chunks(rows, batch_size, BATCH_BYTES // expected.token_bytes):
        lengths = [int(r.num_tokens) for r in chunk]
        # The batch's states in one buffer, each sample read straight into its place: nothing to concatenate.
        states = np.empty((sum(lengths), len(expected.captures), expected.hidden_size), dtype=storage)
        places = [states[end - length : end] for end, length in zip(itertools.accumulate(lengths), lengths)]
        # Each row's frame and the CRCs of the values it gives back (_verified_states proved it): those
        # validate recorded, or (fp8) those of the values read back.
        frames, crcs = zip(*readers.map(_verified_states, [r.sample_id for r in chunk],
                                        [captures[r.sample_id] for r in chunk], places, [compression] * len(chunk)))
        frames, crcs = list(frames), list(crcs)
        stored = frames if compression else [place.reshape(-1).view(np.uint8) for place in places]
        yield {
            "sample_id": [r.sample_id for r in chunk],
            "input_ids": fmt.list_array([r.input_ids for r in chunk]),
            "loss_mask": fmt.list_array([r.loss_mask for r in chunk]),
            "seq_len": lengths,
            fmt.STATES_CRC: crcs,
            # One CRC of the very bytes the row stores (and of its captures' CRCs): what readers check first.
            fmt.STORED_CRC: [fmt.stored_crc(b, c) for b, c in zip(stored, crcs)],
            fmt.TOKENS_CRC: [fmt.tokens_crc(r.sample_id, r.input_ids, r.loss_mask, n) for r, n in zip(chunk, lengths)],
        }, fmt.frames_array(frames) if compression else fmt.states_array(states, lengths, expected.dtype)


def run(job: PackJob) -> dict:
    work = Path(job.out_dir).with_name(f".{Path(job.out_dir).name}.shards")
    store = job.store or Store.at(work)
    check_room(job.states, job.out_dir, store, "the packed dataset")  # before anything is written
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    duplicates, summaries = str(work / "duplicates.parquet"), []
    write_index(job.tokenized, duplicates)
    for i, paths in enumerate(zip(job.tokenized, job.skipped, job.states, job.quarantined)):
        summaries.append(str(work / f"shard-{i:05d}.json"))
        pack_shard(ShardPackJob(*paths, duplicates, i, str(work / f"shard-{i:05d}.arrow"), summaries[-1],
                                job.metadata, store, job.out_dir, job.batch_size, job.threads))
    counts = index(IndexJob(summaries, job.skipped, job.quarantined, job.out_dir, job.counts_out,
                            job.conversations_in, job.metadata))
    shutil.rmtree(work)
    return counts


def pack_shard(job: ShardPackJob) -> dict:
    """One validated shard into one Arrow file (written under a temporary name, renamed when finished)
    and a summary of what it packed and what it recorded as duplicates."""
    meta = job.metadata
    expected = Expected.from_metadata(meta)  # what each states file holds, as the dataset will say
    features = fmt.meta_features(meta)
    compression = None
    if fmt.is_compressed(meta):
        # One Blosc2 thread a sample: the job's threads compress that many samples side by side.
        compression = Compression.from_metadata(meta["compression"], 1)
    check_room([job.states], job.arrow, job.store, "the packed shard", job.dataset)
    began = time.perf_counter()
    tokenized, manifest, quarantined = _checked_shard(job.tokenized, job.states, job.quarantined, expected)
    seen, dup_rows = packed_earlier(job.duplicates, job.shard), []
    # Only what this shard packs: a duplicate stays with the earlier shard.
    job.store.ensure(tokenized.loc[~tokenized["sample_id"].isin(seen), "sample_id"])
    skipped = check(SkippedShard, pd.read_parquet(job.skipped), job.skipped)
    split = _split_samples([tokenized, quarantined, skipped])
    packed, nbytes, raw = 0, 0, 0
    n_readers = max(READERS, job.threads) if compression else READERS
    with atomic_path(job.arrow) as tmp, ThreadPoolExecutor(n_readers, "eagle3data-pack-read") as readers:
        writer = ArrowWriter(features=features, path=str(tmp))
        # The next batch's files are read and verified in threads while this batch is written, and the
        # disk writes each batch back while the next is read: the file's fsync at the end finds little to
        # do (it took 1.1 of 4.7 s packing 1.9 GB here, the whole write-back).
        batches = _shard_batches(tokenized, manifest, seen, dup_rows, job.batch_size, expected, readers, compression)
        for columns, states in ahead(batches):
            batch = _record_batch(columns, states, features)
            writer.write_table(batch)
            writer.stream.flush()
            start_writeback(tmp)
            packed += batch.num_rows
            nbytes += batch.nbytes
            raw += sum(columns["seq_len"]) * expected.token_bytes
            del columns, states, batch  # before the next is read: two batches in memory at most
        writer.finalize()
        writer.close()
    summary = {"arrow": str(job.arrow), "packed": packed, "split_samples": split, "pack_bytes": nbytes,
               "states_bytes": raw, "pack_seconds": time.perf_counter() - began, "duplicates": dup_rows}
    atomic_write_text(job.summary, json.dumps(summary, indent=2))
    logger.info("packed %d samples (%.1f MB of states%s) of %s into %s", packed, raw / 1e6,
                f", stored in {nbytes / 1e6:.1f} MB with {meta['compression']['codec']}"
                + (f" as {compression.precision}" if compression.lossy else "") if compression else "",
                job.tokenized, job.arrow)
    if job.store.drops:
        duplicates = {d["sample_id"] for d in dup_rows}  # packed by an earlier shard, maybe not yet
        validated = manifest[manifest["sample_id"].isin(duplicates)].sort_values("slot")
        held = held_elsewhere(job.store, validated.groupby("sample_id")["checksum"].agg(list).to_dict(),
                              len(expected.captures), expected.hidden_size)
        dropped = job.store.drop((set(tokenized["sample_id"]) - duplicates) | set(held))
        logger.info("dropped %d states files from %s: %s holds them (storage.drop_packed_states)",
                    dropped, job.store.samples, job.arrow)
        faults.point(f"dropped:{job.arrow}")
    return summary


def check_room(states: list[str], out: str, store: Store, what: str, earlier_dataset: str = "") -> None:
    """The packed files hold a second copy of every validated state: refuse to start packing on a disk
    that cannot take it. A shard packed again takes room beside the one it replaces while an earlier
    dataset (rule pack's, replaced only when pack runs) links that one: the refusal says so, and the
    user, whose trainer may be reading it, decides whether to delete it."""
    states_bytes = sum(_validated_bytes(p) for p in states)
    logger.info("pack: %.2f GiB of validated states to write into %s", states_bytes / 2**30, out)
    try:
        store.check_room(states_bytes, out, what)
    except DiskSpaceError as exc:
        if not (earlier_dataset and Path(earlier_dataset).is_dir()):
            raise
        raise DiskSpaceError(f"{exc}\nThe dataset {earlier_dataset}, from an earlier pack, keeps the shards it "
                             "links on this disk until rule pack replaces it: delete it to free their room."
                             ) from None


def _validated_bytes(manifest: str) -> int:
    """The states bytes a validated manifest lists, from that one column (the shard loop reads the whole
    table later); 0 without the column, which the shard's contract check then names."""
    file = pq.ParquetFile(manifest)
    if "nbytes" not in file.schema_arrow.names:
        return 0
    return int(file.read(columns=["nbytes"]).column("nbytes").to_pandas().sum())


def _record_batch(columns: dict, states, features: datasets.Features):
    import pyarrow as pa

    schema = features.arrow_schema
    arrays = [states if name == "hidden_states" else pa.array(columns[name], type=schema.field(name).type)
              for name in schema.names]
    return pa.Table.from_arrays(arrays, schema=schema)


def _split_samples(shard_tables: list[pd.DataFrame]) -> int:
    """Samples beyond one per conversation in a shard's tables (kept, quarantined, skipped at tokenize):
    within a shard, a conversation's samples share its `source_row`."""
    rows = pd.concat([t["source_row"] for t in shard_tables], ignore_index=True)
    return len(rows) - rows.nunique()
