"""Compression of the states (`storage.compression`, on by default): Blosc2, byte shuffle + zstd.

A bf16 state's two bytes differ: the high one (sign and most of the exponent) repeats from value to
value and compresses to ~0.4 of itself, the low one (mantissa) hardly at all. Blosc2's byte-shuffle
filter puts each byte position of a block's values together before zstd (level 1) compresses it, which
stores real SmolLM2-135M-Instruct states at ~0.71 of their raw bytes, bit for bit (plain zstd ~0.81, LZ4
with the shuffle ~0.9; the storage benchmark). The library does all of it: no byte of the format
is this project's own.

One row of the packed dataset holds its `[L, n_captures, H]` states, C order, in their storage dtype
(bf16 as its 16-bit patterns), as one Blosc2 contiguous frame (a super-chunk's `to_cframe()`): chunks of
at most CHUNK_BYTES (a frame of any size), blocks of BLOCK_BYTES compressed independently (in parallel
by Blosc2's threads). The frame describes itself (codec, filter, sizes), so `decode` needs only the
shape's last two dimensions; the dataset's metadata names the codec and its settings (`metadata`), and
a dataset without the key (written before compression, or with `codec: none`) holds raw values.

The engine's writer threads write each sample's store file raw: compressing there, in the engine's
process, slowed extraction even where the writers kept up with the GPU (capture/connector.py).
Pack compresses each sample as it packs it, in threads of its own process (`encode`), and proves each
frame by decompressing it against the CRCs validate recorded. A store file written compressed by an earlier version (`hidden_states_frame`
beside `token_ids`, its safetensors metadata `FRAME_KEY` saying what the frame holds) is still read, and
pack stores its frame as it is after checking its bytes against the CRC its header states.

`precision: fp8_e4m3` (lossy, never the default; storage/fp8.py) stores each value as a float8 e4m3 code
with a float32 scale per token and capture, in the same frame: the codes are its data (one byte a value, so
the shuffle leaves them as they are), the scales its variable-length metadata `scales` (`[L, n_captures]`,
little-endian), and its fixed metalayer `FP8_META` says so and names the dtype the values read back in.
`decode` reads either kind of frame into the same values' dtype, so a dataset may hold both.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import numpy as np
from isal import isal_zlib

from eagle3data.storage import fp8

LIBRARY = "blosc2"
CODECS = ("zstd", "lz4", "none")
PRECISIONS = ("exact", "fp8_e4m3")  # storage.compression.precision: the captured values, or e4m3 codes
FP8_META = "eagle3data"  # an fp8 frame's metalayer: {"precision": "fp8_e4m3", "dtype": what its values read back in}
FP8_SCALES = "scales"  # an fp8 frame's vlmeta entry: float32 [L, n_captures], little-endian
CONTAINER = "Blosc2 contiguous frame (cframe) per row: the row's [seq_len, n_captures, hidden_size]"
FILTER = "shuffle"  # Blosc2's byte shuffle: each byte position of a block's values together
BLOCK_BYTES = 1 << 20  # measured on real SmolLM2 states: 1 MiB 0.713, Blosc2's automatic size 0.721
CHUNK_BYTES = 1 << 28  # Blosc2's chunks hold < 2 GiB; a 128k-token Kimi sample (7 GB) takes 27 of these
FRAME_TENSOR = "hidden_states_frame"  # a compressed store file's states: the frame's bytes
FRAME_KEY = "eagle3data.states_frame"  # its safetensors metadata entry: what the frame holds (`file_entries`)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Compression:
    """How the states are stored: `codec` zstd or lz4 at `level`, with Blosc2's byte shuffle, or none
    (raw values, the format before compression); `threads` Blosc2 threads a row; `precision` exact (the
    values bit for bit) or fp8_e4m3 (lossy codes in the frame, storage/fp8.py)."""

    codec: str
    level: int
    threads: int = 1
    precision: str = "exact"

    def __post_init__(self):
        if self.codec not in CODECS:
            raise ValueError(f"storage.compression.codec: expected one of {CODECS}, found {self.codec!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"storage.compression.precision: expected one of {PRECISIONS}, found {self.precision!r}")
        if self.lossy and not self.enabled:
            raise ValueError("storage.compression.precision: fp8_e4m3 stores its codes in a frame, and codec none "
                             "stores raw values: set codec zstd or lz4, or precision exact")

    @classmethod
    def from_config(cls, storage: dict, threads: int = 1) -> Compression:
        """From the `storage` section, its `compression` block (config/schema.yaml fills in its defaults)."""
        block = storage["compression"]
        return cls(block["codec"], block["level"], threads, block["precision"])

    @classmethod
    def from_metadata(cls, about: dict, threads: int = 1) -> Compression:
        """From a dataset's metadata `compression` (`metadata`; without `precision`: exact)."""
        return cls(about["codec"], about["level"], threads, about.get("precision", "exact"))

    @property
    def enabled(self) -> bool:
        return self.codec != "none"

    @property
    def lossy(self) -> bool:
        return self.precision != "exact"

    def metadata(self) -> dict:
        """What the dataset's metadata says about its stored states (the threads are not a property of
        the bytes, so not stated; `precision` only where it is not exact, as before it existed)."""
        if not self.enabled:
            return {"codec": "none"}
        import blosc2

        about = {"library": LIBRARY, "version": blosc2.__version__, "container": f"{CONTAINER} states, C order, "
                 "storage dtype",
                 "codec": self.codec, "level": self.level, "filter": FILTER, "block_bytes": BLOCK_BYTES,
                 "chunk_bytes": CHUNK_BYTES}
        if not self.lossy:
            return about
        return about | {
            "precision": self.precision, "lossy": True,
            "container": f"{CONTAINER} float8 e4m3 codes (torch.float8_e4m3fn's bytes), C order; its metalayer "
                         f"{FP8_META!r} names the precision and the dtype read back",
            "scales": f"the frame's vlmeta {FP8_SCALES!r}: float32 [seq_len, n_captures], little-endian, each "
                      "token's largest magnitude in that capture / 448; a value reads back as its code times "
                      "its scale in float32, rounded to the dataset's dtype",
            "error_bound": {"relative": fp8.RELATIVE_ERROR, "absolute_of_token_max": fp8.ABSOLUTE_ERROR,
                            "holds": "|read - captured| <= relative * |captured| + absolute_of_token_max * the "
                                     "largest |captured| of the value's token in its capture (at least 448 * "
                                     "2^-100)"},
        }

    def same_frames(self, other: Compression | None) -> bool:
        """Whether `other`'s frames are byte for byte what this one would write."""
        return other is not None and (self.codec, self.level, self.precision) == (other.codec, other.level,
                                                                                  other.precision)

    def encode(self, states: np.ndarray) -> bytes:
        """One row's states (C-contiguous, their storage dtype) as a Blosc2 frame, their values or (fp8)
        their e4m3 codes and scales: its chunks compressed with Python's lock released (pack's threads
        compress side by side), then framed (`to_cframe` holds the lock while it copies the frame
        together: ~5 ms a 16 MB sample)."""
        if not self.enabled:
            raise ValueError("encode: codec none stores raw values, no frame")
        if not states.flags.c_contiguous:
            raise ValueError("encode: expected C-contiguous states")
        if not self.lossy:
            return self._framed(states)
        codes, scales = fp8.quantize(states)
        about = {"precision": self.precision, "dtype": fp8.VALUE_DTYPES[states.itemsize]}
        return self._framed(codes, {FP8_META: about}, {FP8_SCALES: scales.astype("<f4").tobytes()})

    def _framed(self, values: np.ndarray, meta: dict | None = None, vlmeta: dict | None = None) -> bytes:
        """C-contiguous values as a frame, byte-shuffled by their size; `meta`: its fixed metalayers,
        `vlmeta`: its variable-length metadata."""
        blosc2 = _blosc2()
        cparams = blosc2.CParams(
            codec=blosc2.Codec.ZSTD if self.codec == "zstd" else blosc2.Codec.LZ4, clevel=self.level,
            typesize=values.itemsize, nthreads=self.threads, blocksize=BLOCK_BYTES,
            filters=[blosc2.Filter.NOFILTER] * 5 + [blosc2.Filter.SHUFFLE],
        )
        flat = values.reshape(-1).view(np.uint8)
        framed = blosc2.SChunk(chunksize=max(min(flat.nbytes, CHUNK_BYTES), values.itemsize), cparams=cparams,
                               **({"meta": meta} if meta else {}))
        for start in range(0, max(flat.nbytes, 1), CHUNK_BYTES):
            framed.append_chunk(blosc2.compress2(flat[start : start + CHUNK_BYTES], cparams=cparams))
        for name, content in (vlmeta or {}).items():
            framed.vlmeta[name] = content
        return framed.to_cframe()


class FrameError(ValueError):
    """Stored states that are not a whole Blosc2 frame of the expected shape."""


def frame_checksum(frame) -> str:
    """The CRC32 of a frame's bytes, as a store file's metadata states it (ISA-L: the values of zlib's)."""
    return f"{isal_zlib.crc32(frame):08x}"


def frame_tokens(frame, token_values: int) -> int:
    """The tokens a frame holds (its values, or fp8 codes, over `token_values`: n_captures x hidden_size),
    from its header alone (~20 µs): -1 if it is not a frame or holds no whole tokens."""
    import blosc2

    try:
        chunked = blosc2.schunk_from_cframe(frame, copy=False)
    except Exception:  # noqa: BLE001 (Blosc2 raises several kinds for bytes that are no frame)
        return -1
    values, partial = divmod(int(chunked.nbytes), chunked.typesize)
    return values // token_values if not partial and not values % token_values else -1


def precision(frame) -> str:
    """What a frame's values are (PRECISIONS): exact, or fp8_e4m3 as its metalayer says."""
    return _precision(_schunk(frame))


@functools.cache
def _blosc2():
    """Blosc2 (imported on first use: 0.3 s), set once to release the GIL while it (de)compresses:
    pack's reader threads then compress side by side and read the next files meanwhile."""
    import blosc2

    blosc2.set_releasegil(True)
    return blosc2


STORAGE_BY_SIZE = {2: np.dtype(np.uint16), 4: np.dtype(np.float32)}  # contracts.dtypes.STORAGE by value size


def decode(frame, n_captures: int, hidden_size: int, dtype: np.dtype | None = None,
           threads: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """A row's states `[L, n_captures, hidden_size]` from its frame (any bytes-like object: an Arrow
    buffer is read in place), in new memory of `dtype` (default: the storage dtype of the frame's value
    size; an fp8 frame's: the dtype its metalayer names) or in `out` (C-contiguous, the frame's shape);
    `threads` Blosc2 threads (default: Blosc2's)."""
    chunked = _schunk(frame)
    if _precision(chunked) != "exact":
        return _decode_fp8(chunked, n_captures, hidden_size, dtype, threads, out)
    dtype = np.dtype(dtype) if dtype is not None else STORAGE_BY_SIZE.get(chunked.typesize, np.dtype(np.uint8))
    row = n_captures * hidden_size * dtype.itemsize
    if chunked.typesize != dtype.itemsize or chunked.nbytes % row:
        raise FrameError(f"a frame of {chunked.nbytes} bytes of {chunked.typesize}-byte values is no "
                         f"[L, {n_captures}, {hidden_size}] {dtype}")
    shape = (chunked.nbytes // row, n_captures, hidden_size)
    out = _into(out, shape, dtype)
    _decompress(chunked, out.reshape(-1).view(np.uint8), threads)
    return out


def _into(out: np.ndarray | None, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """Where a frame's values go: new memory, or `out` if it is C-contiguous of that shape and dtype."""
    if out is None:
        return np.empty(shape, dtype=dtype)
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
        raise FrameError(f"a frame of {list(shape)} {dtype} where {list(out.shape)} {out.dtype} was expected")
    return out


def _schunk(frame):
    try:
        return _blosc2().schunk_from_cframe(frame, copy=False)
    except Exception as exc:  # noqa: BLE001
        raise FrameError(f"stored states are not a Blosc2 frame: {type(exc).__name__}: {exc}") from exc


def _precision(chunked) -> str:
    if FP8_META not in chunked.meta:
        return "exact"
    about = chunked.meta[FP8_META]
    found = about.get("precision") if isinstance(about, dict) else None
    if found not in PRECISIONS[1:] or about.get("dtype") not in fp8.VALUE_DTYPES.values():
        raise FrameError(f"a frame whose metalayer {FP8_META!r} is {about!r}: not {PRECISIONS[1:]} codes of "
                         f"{tuple(fp8.VALUE_DTYPES.values())}")
    return found


def _decompress(chunked, flat: np.ndarray, threads: int | None) -> None:
    """A frame's chunks into `flat` (bytes, exactly the frame's size)."""
    blosc2, start = _blosc2(), 0
    for n in range(chunked.nchunks):
        # Chunk by chunk with decompress2, which releases the GIL (the frame's own readers hold it): a
        # trainer's reader threads decode rows side by side. One thread a block at most: a context with
        # more threads starts them for every call (~ms).
        chunk = chunked.get_chunk(n)
        nbytes, _, blocksize = blosc2.get_cbuffer_sizes(chunk)
        workers = max(1, min(threads or blosc2.nthreads, -(-nbytes // blocksize)))
        try:
            blosc2.decompress2(chunk, dst=flat[start : start + nbytes], nthreads=workers)
        except (ValueError, RuntimeError) as exc:
            raise FrameError(f"chunk {n} of a frame does not decompress: {exc}") from exc
        start += nbytes
    if start != chunked.nbytes:
        raise FrameError(f"a frame's chunks hold {start} bytes, its header says {chunked.nbytes}")


def _decode_fp8(chunked, n_captures: int, hidden_size: int, dtype: np.dtype | None, threads: int | None,
                out: np.ndarray | None) -> np.ndarray:
    """An fp8 frame's codes and scales read back as values (storage/fp8.py)."""
    size = {name: size for size, name in fp8.VALUE_DTYPES.items()}[chunked.meta[FP8_META]["dtype"]]
    dtype = np.dtype(dtype) if dtype is not None else STORAGE_BY_SIZE[size]
    row = n_captures * hidden_size
    if chunked.typesize != 1 or chunked.nbytes % row or dtype.itemsize not in fp8.VALUE_DTYPES:
        raise FrameError(f"an fp8 frame of {chunked.nbytes} bytes of {chunked.typesize}-byte codes is no "
                         f"[L, {n_captures}, {hidden_size}] {dtype}")
    codes = np.empty((chunked.nbytes // row, n_captures, hidden_size), np.uint8)
    _decompress(chunked, codes.reshape(-1), threads)
    try:
        scales = np.frombuffer(chunked.vlmeta[FP8_SCALES], "<f4")
    except Exception as exc:  # noqa: BLE001 (a damaged trailer fails in Blosc2's and msgpack's ways)
        raise FrameError(f"an fp8 frame without its {FP8_SCALES!r}: {type(exc).__name__}: {exc}") from exc
    if scales.size != codes.shape[0] * n_captures:
        raise FrameError(f"an fp8 frame of {codes.shape[0]} tokens with {scales.size} scales, not "
                         f"{codes.shape[0] * n_captures}")
    values = fp8.dequantize(codes, scales.reshape(codes.shape[:2]), dtype)
    if out is None:
        return values
    np.copyto(_into(out, values.shape, dtype), values)
    return out


CRC_BLOCK_BYTES = 1 << 20  # capture_crcs gathers a capture's values this many bytes at a time (cache-sized)
_gathered = threading.local()  # per reader thread: one block of a capture's values, reused


def capture_crcs(states: np.ndarray) -> list[int]:
    """The CRC32 of each capture of a row's states `[T, n, H]` (raw values, storage dtype), in slot order:
    the bytes of `states[:, slot, :]` token by token, as validate records them (`reading.crc`) and as the
    packed dataset's `hidden_states_crc32` states them. Each capture is gathered into a small buffer of the
    thread's own, CRC_BLOCK_BYTES at a time, and checksummed with one ISA-L call per block: a decoded row is
    checked at ~20 GB/s on 2 cores' 1 KB token rows, where one call per token row ran at ~7 (Python's
    cost per call)."""
    tokens, n, hidden = states.shape
    step = max(1, CRC_BLOCK_BYTES // max(1, hidden * states.itemsize))
    size = min(step, tokens) * hidden * states.itemsize
    held = getattr(_gathered, "bytes", None)
    if held is None or held.size < size:
        held = _gathered.bytes = np.empty(max(size, 1), np.uint8)
    crcs = []
    for slot in range(n):
        value = 0
        for start in range(0, tokens, step):
            block = states[start : start + step, slot, :]
            gathered = held[: block.nbytes].view(states.dtype).reshape(block.shape)
            np.copyto(gathered, block)
            value = isal_zlib.crc32(held[: block.nbytes], value)
        crcs.append(value)
    return crcs
