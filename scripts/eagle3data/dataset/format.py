"""The packed dataset format: a Hugging Face `datasets` Arrow dataset, and how to read it back.

Arrow and `datasets` have no bfloat16, and handing them bf16 tensors silently widens them to float32.
So the states are held as their raw 16-bit patterns, stored in one of two ways, which the metadata's
`compression` names (`storage.compression`; storage/compression.py):
- compressed (`storage.compression.codec: zstd`, the default): `hidden_states` is one Blosc2 frame per row (Arrow
  `large_binary`) holding the row's `[L, n_captures, H]` 16-bit patterns losslessly (~0.71 of the raw bytes on real
  states); `open_dataset` and `decode_states` decompress a row when it is read;
- `codec: none` (and every dataset written before compression, format 1): per sample a list of L rows,
  each a fixed-size list of `n_captures * H` uint16 (slot-major within a token), which `open_dataset`
  views back as bf16 `[L, n_captures, H]` without copying.
What each slot means is in the metadata (`eagle3` key of the dataset info), written by `pack` and
checked by `open_dataset`.

torch is imported where tensors are made, not with the module: the pack_shard and index jobs, which
write and check the dataset's files with numpy and Arrow, then start without it (~5 s of imports on the
H200's VM).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    import torch

METADATA_FILE = "eagle3_metadata.json"
FORMAT_VERSION = 2  # 2: the metadata's `compression` says how hidden_states is stored; 1: raw values
READABLE_VERSIONS = (1, 2)
COLUMNS = ("sample_id", "input_ids", "loss_mask", "seq_len", "hidden_states")
STORAGE_DTYPES = {"bfloat16": "uint16", "float32": "float32"}  # the states' dtype -> its Arrow storage


def torch_dtype(dtype: str) -> torch.dtype:
    from eagle3data.contracts.measuring import DTYPES

    return DTYPES[dtype]


def is_compressed(meta: dict) -> bool:
    """Whether a dataset with this metadata stores its states compressed (a frame per row)."""
    return (meta.get("compression") or {}).get("codec", "none") != "none"


def features(n_captures: int, hidden_size: int, dtype: str, compressed: bool = False) -> datasets.Features:
    storage = STORAGE_DTYPES[dtype]
    states = (datasets.Value("large_binary") if compressed else
              datasets.List(datasets.List(datasets.Value(storage), length=n_captures * hidden_size)))
    return datasets.Features(
        {
            "sample_id": datasets.Value("string"),
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "seq_len": datasets.Value("int32"),
            "hidden_states": states,
        }
    )


def token_bytes(meta: dict) -> int:
    """Raw state bytes a token of this dataset holds (its captures' values in their storage dtype)."""
    return len(meta["captures"]) * meta["hidden_size"] * np.dtype(STORAGE_DTYPES[meta["dtype"]]).itemsize


def meta_features(meta: dict) -> datasets.Features:
    """The features a dataset with this metadata has."""
    return features(len(meta["captures"]), meta["hidden_size"], meta["dtype"], is_compressed(meta))


def states_array(states: np.ndarray, lengths: list[int], dtype: str) -> pa.Array:
    """A batch's states, `[sum(lengths), n, H]` with the samples one after another and held as
    reading.STORAGE holds `dtype` (bf16 as its 16-bit patterns), as the `hidden_states` column: a view of
    the same memory, bf16 not widened."""
    storage = np.dtype(STORAGE_DTYPES[dtype])
    if states.dtype != storage:
        raise TypeError(f"hidden_states of {dtype}: expected them held as {storage}, found {states.dtype}")
    rows = pa.FixedSizeListArray.from_arrays(pa.array(states.reshape(-1)), states.shape[1] * states.shape[2])
    return pa.ListArray.from_arrays(pa.array(np.cumsum([0, *lengths], dtype=np.int32)), rows)


def frames_array(frames: list[bytes]) -> pa.Array:
    """A batch's rows as compressed frames (compression.Compression.encode), as the `hidden_states` column."""
    return pa.array(frames, type=pa.large_binary())


def list_array(rows: list) -> pa.Array:
    """Sequences of numbers (numpy arrays or lists), one per row, as a list column: one concatenation,
    no loop over values (`pa.array(column, type=...)` then casts it, refusing values that do not fit)."""
    values = pa.array(np.concatenate(rows))
    return pa.ListArray.from_arrays(pa.array(np.cumsum([0, *map(len, rows)], dtype=np.int32)), values)


class DatasetFormatError(ValueError):
    pass


class PackedDataset:
    """A packed dataset opened for reading: `len()`, indexing and iteration yield torch tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_file = self.path / METADATA_FILE
        if not meta_file.is_file():
            raise DatasetFormatError(f"{self.path}: no {METADATA_FILE}; not a dataset written by pack")
        self.metadata = json.loads(meta_file.read_text())
        if self.metadata.get("format_version") not in READABLE_VERSIONS:
            raise DatasetFormatError(
                f"{self.path}: format_version {self.metadata.get('format_version')}, "
                f"this reader knows {', '.join(map(str, READABLE_VERSIONS))}: update eagle3data"
            )
        self.hf = datasets.load_from_disk(str(self.path)).with_format("arrow")
        self.n_captures = len(self.metadata["captures"])
        self.hidden_size = self.metadata["hidden_size"]
        self._torch_dtype = torch_dtype(self.metadata["dtype"])

    def __len__(self) -> int:
        return len(self.hf)

    def __getitem__(self, index: int) -> dict:
        return next(self._rows(self.hf[index : index + 1]))

    def __iter__(self) -> Iterator[dict]:
        for batch in self.hf.iter(batch_size=64):
            yield from self._rows(batch)

    def _rows(self, table: pa.Table) -> Iterator[dict]:
        return read_rows(table, self.n_captures, self.hidden_size, self._torch_dtype)


def read_rows(table: pa.Table, n_captures: int, hidden_size: int, torch_dtype: torch.dtype) -> Iterator[dict]:
    """Rows of a packed table as torch tensors; `hidden_states` a read-only view of the table's memory, or
    (compressed) the row decompressed into new memory."""
    import torch

    for i in range(table.num_rows):
        ids = table.column("input_ids")[i].values.to_numpy(zero_copy_only=False)
        mask = table.column("loss_mask")[i].values.to_numpy(zero_copy_only=False)
        with warnings.catch_warnings():  # a read-only view of the memory-mapped file, on purpose
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            states = torch.from_numpy(stored_states(table, i, n_captures, hidden_size)).view(torch_dtype)
        yield {
            "sample_id": table.column("sample_id")[i].as_py(),
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.int64)),
            "hidden_states": states,
        }


def stored_states(table: pa.Table, i: int, n_captures: int, hidden_size: int) -> np.ndarray:
    """Row i's states `[L, n_captures, H]` in their storage dtype (bf16 as its 16-bit patterns): a read-only
    view of raw values, or a compressed row decompressed (the column's type says which: a packed shard
    is read without its dataset's metadata when a dropped store file is restored)."""
    column = table.column("hidden_states")
    if pa.types.is_large_binary(column.type):
        from eagle3data.storage.compression import decode

        return decode(frame_buffer(column, i), n_captures, hidden_size)
    flat = column[i].values.flatten().to_numpy(zero_copy_only=True)
    return flat.reshape(-1, n_captures, hidden_size)


def frame_buffer(column: pa.ChunkedArray, i: int) -> pa.Buffer | None:
    """Row i's compressed frame as a slice of its chunk's data buffer (of the memory-mapped file), not a
    copy: Arrow's scalar copies the frame (`as_buffer`: 2.4 GB of memory for 1.3 GB of frames); None for a
    null row."""
    for chunk in column.chunks:
        if i < len(chunk):
            break
        i -= len(chunk)
    else:
        raise IndexError(f"row {i} of a column of {len(column)}")
    if chunk.null_count and not chunk[i].is_valid:
        return None
    _, offsets, data = chunk.buffers()
    begin, end = np.frombuffer(offsets, dtype=np.int64)[chunk.offset + i : chunk.offset + i + 2]
    return data.slice(int(begin), int(end - begin))


def decode_states(value, metadata: dict) -> torch.Tensor:
    """One row's `hidden_states` as `datasets.load_from_disk` returns it (bytes of a Blosc2 frame, or the
    raw values' nested lists) -> the torch tensor `[L, n_captures, H]` of the metadata's dtype (bf16).
    `metadata`: the dataset's `eagle3_metadata.json` (`read_metadata`)."""
    import torch

    n, hidden = len(metadata["captures"]), metadata["hidden_size"]
    storage = np.dtype(STORAGE_DTYPES[metadata["dtype"]])
    if isinstance(value, (bytes, bytearray, memoryview, pa.Buffer)):
        from eagle3data.storage.compression import decode

        states = decode(value, n, hidden, storage)
    elif isinstance(value, pa.Scalar):
        return decode_states(value.as_buffer() if pa.types.is_large_binary(value.type) else value.as_py(), metadata)
    else:
        states = np.asarray(value, dtype=storage).reshape(-1, n, hidden)
    return torch.from_numpy(states).view(torch_dtype(metadata["dtype"]))


def read_metadata(path: str | Path) -> dict:
    """A packed dataset's metadata (what `decode_states` needs), from its directory."""
    return json.loads((Path(path) / METADATA_FILE).read_text())


def open_dataset(path: str | Path) -> PackedDataset:
    """Open a packed dataset: rows have `input_ids`, `loss_mask` and bf16 `hidden_states [L, n, H]`."""
    return PackedDataset(path)
