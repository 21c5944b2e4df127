"""Re-check a packed dataset on its own: `python -m eagle3data.dataset.check [--full] PATH [PATH ...]`.

A dataset copied, moved or merged by hand has lost the pipeline's guarantees; this restores them from
the dataset alone. The default (quick) check reads no hidden states' values: the metadata is present and
complete, the Arrow schema is the one the metadata implies, the row count equals the packed count
recorded at pack time (and the counts reconcile), sample ids are unique, and every row is whole (ids,
mask and one state row per token; a binary mask with a trainable token). Compressed states
(storage/compression.py) are not decompressed: each row's frame header says how many values it holds
(bf16 values or fp8 codes), one token's states per `n_captures x hidden_size` of them. `pack` runs it on every dataset before
publishing.

`--full` then reads every byte: each data file's Arrow structure validated in full, every row verified
against its checksums (format.py: the CRC32 of its states as stored, and the tokens'; a row that fails
is decoded and each capture's CRC32 computed), rows side by side in `--threads` threads (default: the
cores). Nothing is decoded that passes: pack proved each stored frame gives back the values validate
checked, so the stored bytes' CRC vouches for the values. It lists every damaged row by index, sample and
capture. A dataset of format 3 (no stored CRC) is decoded and verified capture by capture; one packed
before checksums (format 1 or 2) is decoded row by row, its verification "not available".
Exit status 0 with a one-line summary per dataset, 1 with every failure listed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from eagle3data.dataset import format as fmt
from eagle3data.storage.compression import available_cores, frame_tokens
from eagle3data.utils.overlap import ahead
from eagle3data.contracts.failures import BoundaryError, Failure, show, summary, validate
from eagle3data.contracts.schemas import PackedRows

REQUIRED = ("format_version", "model", "hidden_size", "dtype", "captures", "sequence", "fingerprint",
            "counts")


class DatasetCheckError(BoundaryError):
    pass


def _metadata(path: Path) -> tuple[dict, list[Failure]]:
    meta_file = path / fmt.METADATA_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as exc:
        return {}, [Failure("-", "metadata", f"{fmt.METADATA_FILE} as pack writes it",
                            f"{type(exc).__name__}: {exc}", str(meta_file))]
    found = [Failure("-", f"metadata key {key}", "present", "missing", str(meta_file))
             for key in REQUIRED if key not in meta]
    if meta.get("format_version", fmt.FORMAT_VERSION) not in fmt.READABLE_VERSIONS:
        found.append(Failure("-", "metadata format_version", " or ".join(map(str, fmt.READABLE_VERSIONS)),
                             show(meta["format_version"]), str(meta_file)))
    elif meta.get("format_version", fmt.FORMAT_VERSION) >= 2 and "compression" not in meta:
        found.append(Failure("-", "metadata key compression", "present", "missing", str(meta_file)))
    if fmt.has_checksums(meta) and "checksums" not in meta:
        found.append(Failure("-", "metadata key checksums", "present", "missing", str(meta_file)))
    return meta, found


def _counts(meta: dict, rows: int, where: str) -> list[Failure]:
    counts = meta["counts"]
    found = []
    if counts.get("packed") != rows:
        found.append(Failure("-", "rows == counts.packed", show(counts.get("packed")), str(rows), where))
    # A conversation that the template splits into several samples counts once in, once per sample out.
    total = (counts.get("packed") or 0) + (counts.get("skipped") or 0)
    samples_in = (counts.get("conversations_in") or 0) + counts.get("split_samples", 0)
    if samples_in != total:
        found.append(Failure("-", "counts.conversations_in + counts.split_samples == counts.packed + "
                             "counts.skipped", str(total), show(samples_in), where))
    return found


def _per_row(values: pa.Array, weights: np.ndarray, n: int) -> np.ndarray:
    """Per-row sums of `weights`, one weight per element of the list column `values`."""
    parents = pc.list_parent_indices(values).to_numpy()
    return np.bincount(parents, weights=weights, minlength=n).astype(np.int64)


def _frame_rows(column: pa.ChunkedArray, token_values: int) -> np.ndarray:
    """Per row the tokens its compressed frame holds, from the frame's header (-1: not a frame, or not
    whole tokens); only the pages of each frame that Blosc2 reads are touched (`fmt.frame_buffer`)."""
    frames = (fmt.frame_buffer(column, i) for i in range(len(column)))
    return np.array([-1 if frame is None else frame_tokens(frame, token_values) for frame in frames],
                    dtype=np.int64)


def packed_rows(table: pa.Table, token_values: int = 0) -> pd.DataFrame:
    """The PackedRows table of a dataset: lengths and mask counts, computed in Arrow, per row
    (`token_values`: a token's state values, n_captures x hidden_size, for compressed states)."""
    def lengths(name: str) -> np.ndarray:
        return pc.fill_null(pc.list_value_length(table[name]), -1).to_numpy().astype(np.int64)

    mask = table["loss_mask"].combine_chunks()
    mask_values = pc.list_flatten(mask).to_numpy().astype(np.int64)
    n = table.num_rows
    return pd.DataFrame(
        {
            "sample_id": table["sample_id"].to_pylist(),
            "seq_len": table["seq_len"].to_numpy().astype(np.int64),
            "ids_length": lengths("input_ids"),
            "mask_length": lengths("loss_mask"),
            "state_rows": (_frame_rows(table["hidden_states"], token_values)
                           if pa.types.is_large_binary(table["hidden_states"].type) else lengths("hidden_states")),
            "trainable": _per_row(mask, (mask_values == 1).astype(np.int64), n),
            "non_binary_mask": _per_row(mask, ~np.isin(mask_values, (0, 1)), n),
        }
    )


def check_dataset(path: str | Path) -> str:
    """Check the dataset at `path`; return a one-line summary or raise DatasetCheckError listing all."""
    path = Path(path)
    meta, found = _metadata(path)
    if not found:
        want = fmt.meta_features(meta)
        try:
            table = datasets.load_from_disk(str(path)).data.table
        except Exception as exc:  # no state.json, missing or foreign data files
            table = None
            found.append(Failure("-", "load_from_disk", "a loadable dataset", f"{type(exc).__name__}: {exc}",
                                 str(path)))
        if table is not None:
            have = datasets.Features.from_arrow_schema(table.schema)
            columns = [Failure("-", f"column {name}", show(want.get(name)), show(have.get(name)), str(path))
                       for name in dict.fromkeys([*want, *have]) if want.get(name) != have.get(name)]
            found += columns + _counts(meta, table.num_rows, str(path / fmt.METADATA_FILE))
            if not columns:
                found += validate(PackedRows, packed_rows(table, fmt.token_values(meta)), str(path))[1]
    if found:
        total = meta.get("counts", {}).get("packed", 0) if meta else 0
        raise DatasetCheckError(summary(f"dataset {path} fails its checks", found, total, [str(path)]))
    return (f"{path}: OK, {table.num_rows} samples, {len(meta['captures'])} captures x "
            f"{meta['hidden_size']} {meta['dtype']}")


ROWS_A_TASK = 8  # rows one thread verifies at a time in the full check


def data_files(path: Path) -> list[Path]:
    """The dataset's Arrow files in row order, as its state.json lists them."""
    state = json.loads((path / "state.json").read_text())
    return [path / f["filename"] for f in state["_data_files"]]


def record_batches(file: Path) -> Iterator[pa.Table]:
    """A data file's record batches in order (each as a table of one, its structure validated in full),
    read with plain sequential reads: on this project's VMs the page faults of a memory map read a cold
    file at half the disk's rate."""
    with pa.OSFile(str(file)) as source:
        reader = pa.ipc.open_stream(source)
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            batch.validate(full=True)
            yield pa.Table.from_batches([batch])


def full_check(path: str | Path, threads: int | None = None) -> tuple[str, list[Failure]]:
    """Read and verify every byte of the dataset at `path` (it passed `check_dataset`): every failure, by
    row and capture, and a summary of what was read. Each data file is read record batch by record batch
    (pack's batches: at most BATCH_BYTES of states, or one sample), the next read while the threads
    verify this one: the memory of about three batches."""
    path = Path(path)
    meta = fmt.read_metadata(path)
    checked = fmt.has_checksums(meta)
    checker = fmt.RowChecker.of(path, meta)
    threads = threads or available_cores()
    found: list[Failure] = []
    began, first, stored = time.perf_counter(), 0, 0

    def verify(table: pa.Table, rows: range, first: int, where: str, crcs: fmt.TableCrcs | None) -> list[Failure]:
        failed = []
        for i in rows:
            if checked:  # format 4: the stored bytes' CRC, no decoding unless a row fails it
                _, problems = checker.row(table, i, meta["hidden_size"], decode=False, crcs=crcs)
            else:  # no checksums: at least every row decodes
                try:
                    fmt.stored_states(table, i, len(meta["captures"]), meta["hidden_size"])
                    problems = []
                except Exception as exc:  # noqa: BLE001
                    problems = [("hidden_states of every capture", "states that decode", f"{type(exc).__name__}: {exc}")]
            sample = str(table.column("sample_id")[i].as_py())
            failed += [Failure(sample, f"row {first + i}: {what}", want, got, where) for what, want, got in problems]
        return failed

    with ThreadPoolExecutor(threads, thread_name_prefix="eagle3data-check") as pool:
        pending: deque = deque()
        for file in data_files(path):
            stored += file.stat().st_size
            try:
                for table in ahead(record_batches(file)):
                    crcs = fmt.TableCrcs.of(table) if checked else None
                    for start in range(0, table.num_rows, ROWS_A_TASK):
                        pending.append(pool.submit(verify, table, range(start, min(start + ROWS_A_TASK, table.num_rows)),
                                                   first, str(file), crcs))
                        while len(pending) > 4 * threads:
                            found += pending.popleft().result()
                    first += table.num_rows
            except (OSError, pa.ArrowException) as exc:
                found.append(Failure("-", "Arrow structure", "a whole Arrow stream", f"{type(exc).__name__}: {exc}",
                                     str(file)))
        while pending:
            found += pending.popleft().result()
    seconds = time.perf_counter() - began
    what = ("every row's CRC32s verified" + ("" if fmt.has_stored_crc(meta) else " capture by capture (format 3)")
            if checked else
            f"every row decoded; checksums not available (format {meta.get('format_version')})")
    return (f"full: {stored / 1e9:.3f} GB read in {seconds:.1f} s ({stored / 1e9 / max(seconds, 1e-9):.2f} GB/s, "
            f"{threads} threads), {what}"), found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("paths", nargs="+", metavar="PATH", help="packed dataset directory")
    parser.add_argument("--full", action="store_true",
                        help="also read every byte and verify every row's checksums, naming every damaged row")
    parser.add_argument("--threads", type=int, default=None, help="--full: rows verified at once (default: cores)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    status = 0
    for path in args.paths:
        try:
            line = check_dataset(path)
            if args.full:
                done, found = full_check(path, args.threads)
                if found:
                    total = fmt.read_metadata(path)["counts"]["packed"]
                    raise DatasetCheckError(summary(f"dataset {path} fails its full check ({done})", found, total,
                                                    [str(path)]))
                line += f"; {done}"
            print(line)
        except DatasetCheckError as exc:
            print(exc, file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
