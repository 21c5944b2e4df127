"""A states file's `hidden_states` read into numpy memory, and the CRC32s of its bytes, without torch.

Pack reads every byte of every file it packs and compares each capture's CRC with the one validate
recorded; a job that imports no torch starts seconds sooner (~5 s of imports on a GPU node, several
times that under the load of a run's tail). measuring.py reads and checksums through here too, viewing
the same memory as torch tensors, so the bytes and CRCs that pack compares are the ones validate measured.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
from isal import isal_zlib

from eagle3data.contracts.dtypes import HEADER_NAMES, STORAGE
from eagle3data.contracts.states import FACTS_KEY
from eagle3data.storage.compression import FRAME_KEY, FRAME_TENSOR, Compression, FrameError, decode

READ_CHUNK = 1 << 20  # bytes per read call: from disk, 1 MB reads run up to 2x faster than one large one


def checksum(x: np.ndarray) -> str:
    """CRC32 of an array's bytes: recorded by validate, compared by pack when it reads the file again."""
    return f"{crc(x):08x}"


def crc(x: np.ndarray, value: int = 0) -> int:
    """`value` continued over x's bytes. Row by row in place when x is strided (a capture is a slice of
    the file's `[T, n, H]` states, and copying it costs more than the CRC). ISA-L's CRC32 (the same values
    as zlib's) runs at ~22 GB/s over 14 KB rows here, zlib's at ~6."""
    if x.flags.c_contiguous:
        return isal_zlib.crc32(x.reshape(-1).view(np.uint8), value)
    if x.ndim < 2 or x.strides[-1] != x.itemsize:
        return isal_zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8), value)
    for row in x.reshape(-1, x.shape[-1]):
        value = isal_zlib.crc32(row.view(np.uint8), value)
    return value


@dataclass(frozen=True)
class StoredFrame:
    """A compressed store file's frame as read: the settings it was compressed with, the CRC32 of its
    bytes and its states' per-capture CRCs as the file's header states them (None: no facts there), and
    whether it was decompressed."""

    frame: bytearray
    compression: Compression
    checksum: str
    capture_checksums: list[str] | None
    decoded: bool


def open_states(f, path: str, out: np.ndarray | None = None,
                keep: Compression | None = None) -> tuple[np.ndarray, str, StoredFrame | None]:
    """Read the safetensors header of the open file `f` and seek to `hidden_states`; return `out` (checked:
    contiguous, the file's shape and storage dtype) or new memory to read the states into, the states'
    dtype name, and None. A compressed file (`hidden_states_frame`, storage/compression.py) is read whole
    and decompressed into that memory, unless its frame is what `keep` writes (then left as it is), and
    its StoredFrame returned instead of None."""
    size, header_len = os.fstat(f.fileno()).st_size, int.from_bytes(f.read(8), "little")
    if not 2 <= header_len <= size - 8:
        raise ValueError(f"{path}: not a safetensors file (header length {header_len}, {size} bytes)")
    header = json.loads(f.read(header_len))
    metadata = header.get("__metadata__") or {}
    if FRAME_TENSOR in header:
        about = json.loads(metadata.get(FRAME_KEY) or "null")
        if not isinstance(about, dict) or {"shape", "dtype", "codec", "level", "checksum"} - set(about):
            raise ValueError(f"{path}: {FRAME_TENSOR} without its {FRAME_KEY} metadata "
                             "(shape, dtype, codec, level, checksum)")
        dtype, shape, entry = about["dtype"], tuple(about["shape"]), header[FRAME_TENSOR]
    else:
        entry = header["hidden_states"]
        dtype, shape = HEADER_NAMES[entry["dtype"]], tuple(entry["shape"])
    storage = STORAGE[dtype]
    begin, end = (8 + header_len + offset for offset in entry["data_offsets"])
    if end > size or (FRAME_TENSOR not in header and end - begin != math.prod(shape) * storage.itemsize):
        raise ValueError(f"{path}: hidden_states {entry} does not fit the file's {size} bytes")
    if out is None:
        out = np.empty(shape, dtype=storage)
    elif out.dtype != storage or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"{path}: hidden_states {dtype} {list(shape)}, expected {out.dtype} {list(out.shape)}")
    f.seek(begin)
    if FRAME_TENSOR not in header:
        return out, dtype, None
    frame = bytearray(end - begin)
    read_into(f, memoryview(frame), path)
    compression = Compression(about["codec"], about["level"])
    decoded = keep is None or not keep.same_frames(compression)
    if decoded:
        try:
            decode(frame, shape[1], shape[2], storage, threads=1, out=out)
        except (FrameError, IndexError) as exc:
            raise ValueError(f"{path}: {FRAME_TENSOR} is not {dtype} {list(shape)}: {exc}") from exc
    return out, dtype, StoredFrame(frame, compression, about["checksum"], _stated_checksums(metadata), decoded)


def _stated_checksums(metadata: dict) -> list[str] | None:
    """The per-capture CRCs a file's header states (states.FACTS_KEY), by slot; None without them."""
    try:
        return [slot["checksum"] for slot in json.loads(metadata.get(FACTS_KEY) or "null")]
    except (TypeError, KeyError, ValueError):
        return None


def read_into(f, buffer: memoryview, path: str) -> None:
    """Fill `buffer` from `f` with plain sequential reads of READ_CHUNK bytes."""
    done = 0
    while done < len(buffer):
        n = f.readinto(buffer[done : done + READ_CHUNK])
        if not n:
            raise EOFError(f"{path}: file shrank while being read")
        done += n


def as_bytes(x: np.ndarray) -> memoryview:
    return memoryview(x.reshape(-1).view(np.uint8))


def load_states(path: str, out: np.ndarray | None = None) -> np.ndarray:
    """The file's `hidden_states` in its storage dtype (see `read_states`)."""
    return read_states(path, out)[0]


def read_states(path: str, out: np.ndarray | None = None,
                keep: Compression | None = None) -> tuple[np.ndarray, str, StoredFrame | None]:
    """The file's `hidden_states` in its storage dtype, read with plain sequential reads (a memory map costs
    a page fault per page touched: half the speed from disk, a third from the page cache) into new memory,
    or into `out` (pack reads each sample straight into its batch); their dtype's name; and the file's
    frame if it is compressed (left compressed, `out` untouched, if `keep` writes the same frames)."""
    with open(path, "rb", buffering=0) as f:
        out, dtype, stored = open_states(f, path, out, keep)
        if stored is None:
            read_into(f, as_bytes(out), path)
    return out, dtype, stored
