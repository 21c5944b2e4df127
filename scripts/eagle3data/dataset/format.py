"""The packed dataset format: a Hugging Face `datasets` Arrow dataset, and how to read it back.

Arrow and `datasets` have no bfloat16, and handing them bf16 tensors silently widens them to float32.
So the states are held as their raw 16-bit patterns, stored in one of two ways, which the metadata's
`compression` names (`storage.compression`; storage/compression.py):
- compressed (`storage.compression.codec: zstd`, the default): `hidden_states` is one Blosc2 frame per row (Arrow
  `large_binary`) holding the row's `[L, n_captures, H]` 16-bit patterns losslessly (~0.71 of the raw bytes on real
  states); `open_dataset` and `decode_states` decompress a row when it is read;
- `codec: none` (and every dataset written before compression, format 1): per sample a list of L rows,
  each a fixed-size list of `n_captures * H` uint16 (slot-major within a token), which `open_dataset`
  views back as bf16 `[L, n_captures, H]` without copying;
- `precision: fp8_e4m3` (lossy, opt-in): the frame holds float8 e4m3 codes and a scale per token and
  capture (storage/fp8.py), and its metalayer says so: readers return the same bf16 `[L, n_captures, H]`,
  within the bound the metadata's `compression.error_bound` states. A row says what it holds, so a dataset
  may mix exact and fp8 frames.
What each slot means is in the metadata (`eagle3` key of the dataset info), written by `pack` and
checked by `open_dataset`.

Every row carries checksums (format 4): `hidden_states_crc32`, per capture in slot order the CRC32 of
the values the row reads back as (`[L, H]` in storage dtype, token by token: for an exact row the CRCs
validate recorded and pack proved the stored bytes give back; for an fp8 row those of its decoded values,
which pack checked within the error bound of the validated ones); `hidden_states_stored_crc32`, one CRC32 of the row's `hidden_states` as stored
(a compressed row's Blosc2 frame, a raw row's values buffer) continued over its `hidden_states_crc32`
(uint32, little-endian); and `tokens_crc32`, the CRC32 of the row's sample id (UTF-8), `input_ids`
(int32), `loss_mask` (int8) and `seq_len` (int32), little-endian, in that order. Every reader here
verifies them by default (`RowChecker`): the stored CRC, one ISA-L pass over contiguous bytes (a
compressed row's frame, ~0.7 of the raw bytes, right after it is decoded, while its bytes are in the CPU's
cache); only a row that fails it has its captures' CRCs computed, to name the damaged capture(s). A
changed byte is an `IntegrityError` naming the dataset, the row and the capture, never changed values.
`verify=False`, or `EAGLE3DATA_VERIFY=0` in the environment (for the trainers' readers, which take no
arguments of ours), skips it. A dataset of format 3 has no stored CRC: its rows are verified capture by
capture from their values (decoded, each capture gathered), which costs readers more. A dataset of
format 1 or 2 has no checksums: it loads, and says verification is "not available".

torch is imported where tensors are made, not with the module: the pack_shard and index jobs, which
write and check the dataset's files with numpy and Arrow, then start without it (~5 s of imports on a
GPU node).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import numpy as np
import pyarrow as pa
from isal import isal_zlib

from eagle3data.contracts.dtypes import STORAGE
from eagle3data.storage import compression

from eagle3data.utils.logs import get_logger

if TYPE_CHECKING:
    import torch

METADATA_FILE = "eagle3_metadata.json"
# 4: every row carries the CRC32 of its states as stored; 3: every row carries its captures' and tokens' CRC32s;
# 2: the metadata's `compression` says how hidden_states is stored; 1: raw
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
STATES_CRC = "hidden_states_crc32"  # per row: [n_captures] uint32, each capture's raw values
STORED_CRC = "hidden_states_stored_crc32"  # per row: uint32 of hidden_states as stored, then STATES_CRC
TOKENS_CRC = "tokens_crc32"  # per row: uint32 of sample_id, input_ids, loss_mask, seq_len
COLUMNS = ("sample_id", "input_ids", "loss_mask", "seq_len", "hidden_states", STATES_CRC, STORED_CRC, TOKENS_CRC)
CHECKSUMS = {  # the metadata's `checksums`: what the three columns hold
    "algorithm": "CRC-32 (zlib's polynomial and values)",
    STATES_CRC: "per capture, slot order: the capture's values as the row reads back [seq_len, hidden_size] in "
                "the storage dtype (bf16 as its 16-bit patterns), token by token: the raw values as validate "
                "recorded them; for a row stored as fp8_e4m3 codes (lossy), the values its frame decodes to",
    STORED_CRC: "hidden_states as stored (compressed: the Blosc2 frame's bytes; raw: the row's values "
                "[seq_len, n_captures * hidden_size], C order, little-endian), then the row's "
                "hidden_states_crc32 as uint32 little-endian, in that order",
    TOKENS_CRC: "sample_id (UTF-8), input_ids (int32), loss_mask (int8), seq_len (int32), little-endian, in "
                "that order",
}
logger = get_logger(__name__)
VERIFY_ENV = "EAGLE3DATA_VERIFY"  # "0": readers skip verifying the checksums (the default verifies)


def torch_dtype(dtype: str) -> torch.dtype:
    from eagle3data.contracts.measuring import TORCH_DTYPES

    return TORCH_DTYPES[dtype]


def has_checksums(meta: dict) -> bool:
    """Whether a dataset with this metadata carries checksums (format 3; metadata without a version is
    being packed now, so yes)."""
    return meta.get("format_version", FORMAT_VERSION) >= 3


def has_stored_crc(meta: dict) -> bool:
    """Whether a dataset with this metadata carries the CRC of its states as stored (format 4)."""
    return meta.get("format_version", FORMAT_VERSION) >= 4


def verifying(verify: bool | None = None) -> bool:
    """Whether a reader verifies checksums: `verify` where given, else unless EAGLE3DATA_VERIFY=0."""
    return verify if verify is not None else os.environ.get(VERIFY_ENV, "1").strip().lower() not in ("0", "false", "no")


def is_compressed(meta: dict) -> bool:
    """Whether a dataset with this metadata stores its states compressed (a frame per row)."""
    return (meta.get("compression") or {}).get("codec", "none") != "none"


def features(n_captures: int, hidden_size: int, dtype: str, compressed: bool = False,
             checksums: bool = True, stored_checksum: bool = True) -> datasets.Features:
    storage = STORAGE[dtype].name
    states = (datasets.Value("large_binary") if compressed else
              datasets.List(datasets.List(datasets.Value(storage), length=n_captures * hidden_size)))
    columns = {
        "sample_id": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "seq_len": datasets.Value("int32"),
        "hidden_states": states,
    }
    if checksums:
        columns[STATES_CRC] = datasets.List(datasets.Value("uint32"), length=n_captures)
        if stored_checksum:
            columns[STORED_CRC] = datasets.Value("uint32")
        columns[TOKENS_CRC] = datasets.Value("uint32")
    return datasets.Features(columns)


def token_values(meta: dict) -> int:
    """State values a token of this dataset holds: its captures' hidden values."""
    return len(meta["captures"]) * meta["hidden_size"]


def meta_features(meta: dict) -> datasets.Features:
    """The features a dataset with this metadata has."""
    return features(len(meta["captures"]), meta["hidden_size"], meta["dtype"], is_compressed(meta),
                    has_checksums(meta), has_stored_crc(meta))


def states_array(states: np.ndarray, lengths: list[int], dtype: str) -> pa.Array:
    """A batch's states, `[sum(lengths), n, H]` with the samples one after another and held as
    dtypes.STORAGE holds `dtype` (bf16 as its 16-bit patterns), as the `hidden_states` column: a view of
    the same memory, bf16 not widened."""
    storage = STORAGE[dtype]
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


class IntegrityError(DatasetFormatError):
    """Stored bytes that are not the ones packed: a row whose checksums fail, or whose states do not
    decode. The message names the dataset, the row, its sample and each failing capture."""


def tokens_crc(sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray, seq_len: int) -> int:
    """A row's `tokens_crc32` (CHECKSUMS)."""
    value = isal_zlib.crc32(sample_id.encode())
    value = isal_zlib.crc32(np.ascontiguousarray(input_ids, dtype="<i4"), value)
    value = isal_zlib.crc32(np.ascontiguousarray(loss_mask, dtype="i1"), value)
    return isal_zlib.crc32(int(seq_len).to_bytes(4, "little", signed=True), value)


def stored_crc(stored, states_crcs) -> int:
    """A row's `hidden_states_stored_crc32` (CHECKSUMS): the CRC32 of `stored`, its hidden_states as stored
    (any C-contiguous buffer: a frame, an Arrow buffer, a raw row's values), then of its
    `hidden_states_crc32` (uint32, little-endian). One ISA-L pass over the bytes where they are."""
    return isal_zlib.crc32(np.ascontiguousarray(states_crcs, dtype="<u4"), isal_zlib.crc32(stored))


def stored_bytes(table: pa.Table, i: int):
    """Row i's hidden_states as stored, not copied: a compressed row's frame (`frame_buffer`), a raw row's
    values, flat (a read-only view of the table's memory); None for a null row."""
    column = table.column("hidden_states")
    if pa.types.is_large_binary(column.type):
        return frame_buffer(column, i)
    values = column[i].values
    return None if values is None else values.flatten().to_numpy(zero_copy_only=True)


@dataclass(frozen=True)
class TableCrcs:
    """A packed table's checksum columns and lengths as numpy arrays, read once for all its rows (a scalar
    read from Arrow costs microseconds a row, a tenth of a short row's reading)."""

    states: np.ndarray  # [rows, n_captures] uint32
    stored: np.ndarray | None  # [rows] uint32; None: format 3
    tokens: np.ndarray  # [rows] uint32
    seq_len: np.ndarray  # [rows] int32

    @classmethod
    def of(cls, table: pa.Table) -> TableCrcs:
        chunks = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in table.column(STATES_CRC).chunks]
        states = np.concatenate(chunks) if chunks else np.empty(0, np.uint32)
        stored = (table.column(STORED_CRC).to_numpy() if table.schema.get_field_index(STORED_CRC) >= 0 else None)
        return cls(states.reshape(table.num_rows, -1), stored, table.column(TOKENS_CRC).to_numpy(),
                   table.column("seq_len").to_numpy())


@dataclass(frozen=True)
class RowChecker:
    """Verifies rows of a packed table against their checksums (`where`: the dataset or file, for messages)."""

    where: str
    captures: tuple[str, ...]  # the captures' names, slot order

    @classmethod
    def of(cls, where: str | Path, meta: dict) -> RowChecker:
        return cls(str(where), tuple(c.get("name", f"slot {s}") for s, c in enumerate(meta["captures"])))

    def row(self, table: pa.Table, i: int, hidden_size: int, tokens: tuple | None = None, decode: bool = True,
            crcs: TableCrcs | None = None, at: int | None = None) -> tuple[np.ndarray | None, list[tuple[str, str, str]]]:
        """Row i's states (None where they do not decode, or where `decode` is False and the row passed) and
        every check it fails: (what, expected, found). `tokens`: its (sample_id, input_ids, loss_mask) where
        the caller has them already; `crcs`: the checksum columns of the table, or of the dataset `table` is
        a slice of (row i at `at` there). A table with `hidden_states_stored_crc32` (format 4) is checked on
        its stored bytes (`check`); a table without it (format 3) capture by capture."""
        if tokens is None:
            tokens = (table.column("sample_id")[i].as_py(),
                      table.column("input_ids")[i].values.to_numpy(zero_copy_only=False),
                      table.column("loss_mask")[i].values.to_numpy(zero_copy_only=False))
        sample_id, ids, mask = tokens
        crcs, at = (crcs, i if at is None else at) if crcs is not None else (TableCrcs.of(table), i)
        stored, n = stored_bytes(table, i), len(self.captures)
        if isinstance(stored, pa.Buffer):  # a compressed row's frame
            def states_of() -> np.ndarray:
                return compression.decode(stored, n, hidden_size)
        else:
            def states_of() -> np.ndarray:
                return stored.reshape(-1, n, hidden_size)
        return self.check(stored, states_of, crcs.states[at], None if crcs.stored is None else int(crcs.stored[at]),
                          int(crcs.tokens[at]), str(sample_id), ids, mask, int(crcs.seq_len[at]), decode)

    def check(self, stored, states_of, states_crcs, stated_stored_crc: int | None, stated_tokens_crc: int,
              sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray, seq_len: int, decode: bool = True
              ) -> tuple[np.ndarray | None, list[tuple[str, str, str]]]:
        """A row's states (`states_of()`: decoded or viewed) and the checks it fails, from the CRCs it states.
        With `stated_stored_crc` (format 4) the states are vouched for by one CRC of `stored` (their bytes
        as stored); they are made only where `decode` asks, and a row that fails is decoded to name its
        captures. The CRC is taken after decoding, while the frame's bytes are in the CPU's cache (before
        it, they came from memory twice: ~3 % more of a reader's time on 2 cores); nothing is returned
        before it passes."""
        failed = self.tokens(stated_tokens_crc, sample_id, input_ids, loss_mask, seq_len)
        states, error, found = None, None, None
        if decode or stated_stored_crc is None:
            states, error = _attempt(states_of)
        if stated_stored_crc is not None:
            found = stored_crc(b"" if stored is None else stored, states_crcs)
            if found == stated_stored_crc:
                return (states, failed) if error is None else (None, [_undecodable(error), *failed])
            if states is None and error is None:
                states, error = _attempt(states_of)
        if error is not None:
            return None, [_undecodable(error), *failed]
        captures = self.compare(states, states_crcs)
        if found is not None and not captures:  # every capture's values as packed: the row's CRC columns changed
            captures = [(f"{STORED_CRC} (hidden_states as stored, then {STATES_CRC})", f"{stated_stored_crc:08x}",
                         f"{found:08x}")]
        return states, captures + failed

    def compare(self, states: np.ndarray, states_crcs) -> list[tuple[str, str, str]]:
        """The captures whose values' CRCs are not the ones stated."""
        return [(f"capture {slot} ({self.captures[slot]}) {STATES_CRC}", f"{want:08x}", f"{got:08x}")
                for slot, (want, got) in enumerate(zip(map(int, states_crcs), capture_crcs(states))) if want != got]

    @staticmethod
    def tokens(stated: int, sample_id: str, input_ids: np.ndarray, loss_mask: np.ndarray,
               seq_len: int) -> list[tuple[str, str, str]]:
        """The row's tokens check, failed or not."""
        got = tokens_crc(sample_id, input_ids, loss_mask, seq_len)
        if stated == got:
            return []
        return [(f"{TOKENS_CRC} (sample_id, input_ids, loss_mask, seq_len)", f"{stated:08x}", f"{got:08x}")]

    def refuse(self, index: int | None, sample_id: str, problems: list[tuple[str, str, str]]) -> IntegrityError:
        row = f"row {index} (sample {sample_id})" if index is not None else f"the row (sample {sample_id})"
        lines = "\n".join(f"  {row} | {what} | expected {want} | found {got}" for what, want, got in problems)
        dataset = self.where if index is not None else "DATASET"
        return IntegrityError(
            f"{self.where}: {row} is not what pack wrote:\n{lines}\nThe stored bytes changed after packing (a "
            f"damaged copy, disk or memory): copy the dataset again from its source, or pack it again. "
            f"`python -m eagle3data.dataset.check --full {dataset}` lists every damaged row."
        )


def _attempt(states_of) -> tuple[np.ndarray | None, Exception | None]:
    try:
        return states_of(), None
    except Exception as exc:  # noqa: BLE001 (a damaged frame fails in Blosc2's several ways)
        return None, exc


def _undecodable(exc: Exception) -> tuple[str, str, str]:
    return "hidden_states of every capture", "states that decode", f"{type(exc).__name__}: {exc}"


def capture_crcs(states: np.ndarray) -> list[int]:
    from eagle3data.storage.compression import capture_crcs as crcs

    return crcs(states)


class PackedDataset:
    """A packed dataset opened for reading: `len()`, indexing and iteration yield torch tensors, each row
    verified against its checksums unless `verify` is False (None: unless EAGLE3DATA_VERIFY=0)."""

    def __init__(self, path: str | Path, verify: bool | None = None):
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
        checked = has_checksums(self.metadata)
        self.checker = RowChecker.of(self.path, self.metadata) if checked and verifying(verify) else None
        self._crcs = None  # the dataset's checksum columns (TableCrcs), read on first verified row
        # What reading verifies: "crc32" (every row, as read), "off" (asked not to), "not available".
        self.verification = "crc32" if self.checker else ("off" if checked else "not available")
        if not checked:
            logger.warning("%s: format %s carries no checksums (packed before they were added): rows are read "
                           "unverified (verification not available); pack it again to have them",
                           self.path, self.metadata.get("format_version"))

    def __len__(self) -> int:
        return len(self.hf)

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += len(self)
        return next(self._rows(self.hf[index : index + 1], index))

    def __iter__(self) -> Iterator[dict]:
        first = 0
        for batch in self.hf.iter(batch_size=64):
            yield from self._rows(batch, first)
            first += batch.num_rows

    def _rows(self, table: pa.Table, first: int) -> Iterator[dict]:
        if self.checker is not None and self._crcs is None:
            self._crcs = TableCrcs.of(self.hf.data.table)
        return read_rows(table, self.n_captures, self.hidden_size, self._torch_dtype, self.checker, first, self._crcs)


def read_rows(table: pa.Table, n_captures: int, hidden_size: int, torch_dtype: torch.dtype,
              checker: RowChecker | None = None, first: int = 0, crcs: TableCrcs | None = None) -> Iterator[dict]:
    """Rows of a packed table as torch tensors; `hidden_states` a read-only view of the table's memory, or
    (compressed) the row decompressed into new memory. With `checker`, each row is verified first (an
    IntegrityError names the row: `first` + its index in `table`); `crcs`: the checksum columns of the
    dataset whose rows from `first` on `table` holds (None: read from `table`)."""
    import torch

    if checker is not None and crcs is None:
        crcs, first_crc = TableCrcs.of(table), 0
    else:
        first_crc = first
    for i in range(table.num_rows):
        sample_id = table.column("sample_id")[i].as_py()
        ids = table.column("input_ids")[i].values.to_numpy(zero_copy_only=False)
        mask = table.column("loss_mask")[i].values.to_numpy(zero_copy_only=False)
        if checker is None:
            stored = stored_states(table, i, n_captures, hidden_size)
        else:
            stored, problems = checker.row(table, i, hidden_size, (sample_id, ids, mask), crcs=crcs, at=first_crc + i)
            if problems:
                raise checker.refuse(first + i, sample_id, problems)
        with warnings.catch_warnings():  # a read-only view of the memory-mapped file, on purpose
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            states = torch.from_numpy(stored).view(torch_dtype)
        yield {
            "sample_id": sample_id,
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(mask.astype(np.int64)),
            "hidden_states": states,
        }


def table_checker(table: pa.Table, where: str | Path, n_captures: int) -> RowChecker | None:
    """A checker for a packed table read without its dataset's metadata (a packed shard in the store):
    None where the table carries no checksums (packed before them)."""
    if STATES_CRC not in table.column_names:
        return None
    return RowChecker(str(where), tuple(f"slot {s}" for s in range(n_captures)))


def stored_states(table: pa.Table, i: int, n_captures: int, hidden_size: int) -> np.ndarray:
    """Row i's states `[L, n_captures, H]` in their storage dtype (bf16 as its 16-bit patterns): a read-only
    view of raw values, or a compressed row decompressed (the column's type says which: a packed shard
    is read without its dataset's metadata when a dropped store file is restored). Not verified: see
    RowChecker."""
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


def decode_states(value, metadata: dict, verify: bool | None = None) -> torch.Tensor:
    """One row's `hidden_states` as `datasets.load_from_disk` returns it -> the torch tensor `[L, n_captures,
    H]` of the metadata's dtype (bf16). `value`: the whole row (`hf[i]`, a dict), whose checksums are then
    verified (one CRC of its stored frame or values, `RowChecker.check`; an IntegrityError names the sample
    and capture), or the row's `hidden_states` alone (bytes of a Blosc2 frame, or the raw values' nested
    lists), which a dataset with checksums refuses unless `verify=False` (None: unless
    EAGLE3DATA_VERIFY=0). `metadata`: the dataset's `eagle3_metadata.json` (`read_metadata`)."""
    import torch

    n, hidden = len(metadata["captures"]), metadata["hidden_size"]
    storage = STORAGE[metadata["dtype"]]
    row = value if isinstance(value, dict) else None
    check = has_checksums(metadata) and verifying(verify)
    if row is not None:
        value = row["hidden_states"]
    elif check:
        raise TypeError("decode_states: this dataset carries checksums; pass the whole row (hf[i]) to verify "
                        "them, or verify=False to decode its hidden_states unverified")
    if isinstance(value, pa.Scalar):
        value = value.as_buffer() if pa.types.is_large_binary(value.type) else value.as_py()
    if isinstance(value, (bytes, bytearray, memoryview, pa.Buffer)):
        from eagle3data.storage.compression import decode

        stored, states_of = value, lambda: decode(value, n, hidden, storage)
    else:
        raw = np.ascontiguousarray(np.asarray(value, dtype=storage).reshape(-1, n, hidden))
        stored, states_of = raw.reshape(-1).view(np.uint8), lambda: raw
    if not check:
        return torch.from_numpy(states_of()).view(torch_dtype(metadata["dtype"]))
    checker, sample_id = RowChecker.of("decode_states", metadata), str(_py(row, "sample_id"))
    states, failed = checker.check(
        stored, states_of, _py(row, STATES_CRC), _py(row, STORED_CRC) if STORED_CRC in row else None,
        _py(row, TOKENS_CRC), sample_id, np.asarray(_py(row, "input_ids")), np.asarray(_py(row, "loss_mask")),
        _py(row, "seq_len"))
    if failed:
        raise checker.refuse(None, sample_id, failed)
    return torch.from_numpy(states).view(torch_dtype(metadata["dtype"]))


def _py(row: dict, key: str):
    value = row[key]
    return value.as_py() if isinstance(value, pa.Scalar) else value


def read_metadata(path: str | Path) -> dict:
    """A packed dataset's metadata (what `decode_states` needs), from its directory."""
    return json.loads((Path(path) / METADATA_FILE).read_text())


def open_dataset(path: str | Path, verify: bool | None = None) -> PackedDataset:
    """Open a packed dataset: rows have `input_ids`, `loss_mask` and bf16 `hidden_states [L, n, H]`, each
    row verified against its checksums as it is read (`verify=False`, or EAGLE3DATA_VERIFY=0: not)."""
    return PackedDataset(path, verify)
