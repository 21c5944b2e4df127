"""Re-check a packed dataset on its own: `python -m eagle3data.dataset.check PATH [PATH ...]`.

A dataset copied, moved or merged by hand has lost the pipeline's guarantees; this restores them from
the dataset alone, without reading the hidden states' values: the metadata is present and complete, the
Arrow schema is the one the metadata implies, the row count equals the packed count recorded at pack
time (and the counts reconcile), sample ids are unique, and every row is whole (ids, mask and one state
row per token; a binary mask with a trainable token). Compressed states (storage/compression.py) are not
decompressed: each row's frame header says how many bytes it holds, one token's states per
`n_captures x hidden_size` values. `pack` runs it on every dataset before publishing.
Exit status 0 with a one-line summary per dataset, 1 with every failure listed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from eagle3data.dataset import format as fmt
from eagle3data.storage.compression import frame_bytes
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


def _frame_rows(column: pa.ChunkedArray, token_bytes: int) -> np.ndarray:
    """Per row the tokens its compressed frame holds, from the frame's header (-1: not a frame, or not
    whole tokens); only the pages of each frame that Blosc2 reads are touched (`fmt.frame_buffer`)."""
    frames = (fmt.frame_buffer(column, i) for i in range(len(column)))
    sizes = np.array([-1 if frame is None else frame_bytes(frame) for frame in frames], dtype=np.int64)
    return np.where((sizes >= 0) & (sizes % token_bytes == 0), sizes // token_bytes, -1)


def packed_rows(table: pa.Table, token_bytes: int = 0) -> pd.DataFrame:
    """The PackedRows table of a dataset: lengths and mask counts, computed in Arrow, per row
    (`token_bytes`: a token's raw state bytes, for compressed states)."""
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
            "state_rows": (_frame_rows(table["hidden_states"], token_bytes)
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
                found += validate(PackedRows, packed_rows(table, fmt.token_bytes(meta)), str(path))[1]
    if found:
        total = meta.get("counts", {}).get("packed", 0) if meta else 0
        raise DatasetCheckError(summary(f"dataset {path} fails its checks", found, total, [str(path)]))
    return (f"{path}: OK, {table.num_rows} samples, {len(meta['captures'])} captures x "
            f"{meta['hidden_size']} {meta['dtype']}")


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        try:
            print(check_dataset(path))
        except DatasetCheckError as exc:
            print(exc, file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
