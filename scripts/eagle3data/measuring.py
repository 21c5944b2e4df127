"""The tensor side of a states file: reading its `hidden_states`, and measuring the facts validate judges
(per capture: non-finite values, zeros, zero and identical rows, mean norm, CRC32), for the connector as
it writes a file (`measured` on the GPU, `written_facts` on the host copy), for validate when a file's
header holds no facts (`capture_facts`), and for pack, which reads every byte and compares the CRCs
(`load_states`, `checksum`). One function computes each fact for all of them, so the facts in a header
and the facts measured from the file are equal bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator

import numpy as np
import torch
from isal import isal_zlib

from eagle3data.overlap import ahead
from eagle3data.states import FACTS_KEY, ITEMSIZES, SAFETENSORS_DTYPES, Expected, manifest_rows

DTYPES = {name: getattr(torch, name) for name in ITEMSIZES}  # the dtypes states.py knows by name
# Each float dtype as integers of its width, and its exponent bits (all set: inf or nan).
_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
         torch.float32: (torch.int32, 0x7F800000)}
_BLOCK_BYTES = 2 << 20  # capture_facts reads and measures this many bytes of tokens at a time
READ_CHUNK = 1 << 20  # bytes per read call: from disk, 1 MB reads run up to 2x faster than one large one


def checksum(x: torch.Tensor) -> str:
    """CRC32 of a tensor's bytes: recorded by validate, compared by pack when it reads the file again."""
    return f"{_crc(x):08x}"


def _crc(x: torch.Tensor, crc: int = 0) -> int:
    """`crc` continued over x's bytes. Row by row in place: a capture is a strided slice of the file's
    tensor, and copying it costs more than the CRC. ISA-L's CRC32 (the same values as zlib's) runs at
    ~22 GB/s over 14 KB rows here, zlib's at ~6: it was the largest cost of validating a sample."""
    if x.dim() < 2 or x.stride(-1) != 1 or x.is_contiguous():
        return isal_zlib.crc32(x.contiguous().view(torch.uint8).numpy(), crc)
    for row in x.reshape(-1, x.shape[-1]).view(torch.uint8).numpy():
        crc = isal_zlib.crc32(row, crc)
    return crc


def _bytes(x: torch.Tensor) -> memoryview:
    return memoryview(x.view(-1).view(torch.uint8).numpy())


def _open_states(f, path: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read the safetensors header of the open file `f` and seek to `hidden_states`; return `out`
    (checked: contiguous, the file's shape and dtype) or new memory, to read the states into."""
    size, header_len = os.fstat(f.fileno()).st_size, int.from_bytes(f.read(8), "little")
    if not 2 <= header_len <= size - 8:
        raise ValueError(f"{path}: not a safetensors file (header length {header_len}, {size} bytes)")
    entry = json.loads(f.read(header_len))["hidden_states"]
    dtype, shape = DTYPES[SAFETENSORS_DTYPES[entry["dtype"]]], list(entry["shape"])
    begin, end = (8 + header_len + offset for offset in entry["data_offsets"])
    if end > size or end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"{path}: hidden_states {entry} does not fit the file's {size} bytes")
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif out.dtype != dtype or list(out.shape) != shape:
        raise ValueError(f"{path}: hidden_states {dtype} {shape}, expected {out.dtype} {list(out.shape)}")
    f.seek(begin)
    return out


def _read_into(f, buffer: memoryview, path: str) -> None:
    done = 0
    while done < len(buffer):
        n = f.readinto(buffer[done : done + READ_CHUNK])
        if not n:
            raise EOFError(f"{path}: file shrank while being read")
        done += n


def load_states(path: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The file's `hidden_states`, read with plain sequential reads (a memory map costs a page fault per
    page touched: half the speed from disk, a third from the page cache) into new memory, or into `out`
    (pack reads each sample straight into its batch)."""
    with open(path, "rb", buffering=0) as f:
        out = _open_states(f, path, out)
        _read_into(f, _bytes(out), path)
    return out


def _read_blocks(f, states: torch.Tensor, step: int, path: str) -> Iterator[int]:
    """Read the states from `f` block by block of `step` tokens; yield each block's first token once read."""
    for start in range(0, states.shape[0], step):
        _read_into(f, _bytes(states[start : start + step]), path)
        yield start


def _magnitudes(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The value bits, sign cleared, of the selected rows of x (a few tokens, if any)."""
    int_dtype = _BITS[x.dtype][0]
    return x[rows].view(int_dtype) & torch.iinfo(int_dtype).max


def measure(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and capture of `block` `[t, n, H]`, on any device: the float32 norm and the least value
    bits with the sign cleared (what `slot_facts` counts from)."""
    int_dtype = _BITS[block.dtype][0]
    return (torch.linalg.vector_norm(block, dim=-1, dtype=torch.float32),
            torch.amin(block.view(int_dtype) & torch.iinfo(int_dtype).max, dim=-1))  # aminmax: 20x slower on ints


def measured(block: torch.Tensor) -> torch.Tensor:
    """`measure` as one float32 tensor `[t, 2, n]` (norms, least bits; those are exact in float32 for 16-bit
    dtypes, and zero stays zero for any): what the connector copies to the host beside the states."""
    norms, low = measure(block)
    return torch.stack((norms, low.float()), dim=1)


def slot_facts(states: torch.Tensor, norms: torch.Tensor, low: torch.Tensor, crcs: list[int]) -> list[dict]:
    """Each capture's facts, in slot order, from the states `[T, n, H]`, their `measure` (the least bits
    in any dtype: only compared with zero) and CRCs.

    Counted on the value bits (torch's isfinite on bf16 is 40x slower): exponent bits all set is inf or
    nan, nothing set is +0 or -0, and only the tokens that can hold such values are counted value by
    value: those whose norm is not finite (inf and nan propagate into it) or is zero, or whose least
    value bits are zero."""
    exponent = _BITS[states.dtype][1]
    facts = []
    for slot in range(states.shape[1]):
        x, norm = states[:, slot, :], norms[:, slot].contiguous()
        nonfinite = int((_magnitudes(x, ~torch.isfinite(norm)) >= exponent).sum())
        zeros = int((_magnitudes(x, low[:, slot] == 0) == 0).sum())
        facts.append({
            "rows": x.shape[0],
            "hidden_size": x.shape[1],
            "nbytes": x.numel() * x.element_size(),
            "nonfinite": nonfinite,
            "zero_fraction": float(np.float32(zeros) / np.float32(x.numel())),  # as float32 mean()
            "zero_rows": int((_magnitudes(x, norm == 0) == 0).all(dim=-1).sum()),
            # Rows 0 and 1 first: for real states that settles it without comparing every row.
            "identical_rows": x.shape[0] > 1 and bool((x[1] == x[0]).all()) and bool((x == x[:1]).all()),
            "mean_norm": float(norm.mean()) if not nonfinite else float("nan"),
            "checksum": f"{crcs[slot]:08x}",
        })
    return facts


def written_facts(states: torch.Tensor, norms: torch.Tensor, low: torch.Tensor) -> str:
    """The facts of the states about to be written (host memory) for the file's header (FACTS_KEY). In
    the connector's writer threads: each capture is copied whole for its CRC, as the row-by-row CRC holds
    Python's lock (which vLLM's engine thread needs) 2,048 times a sample."""
    crcs = [_crc(states[:, slot].contiguous()) for slot in range(states.shape[1])]
    return json.dumps(slot_facts(states, norms, low, crcs))


def facts_header(states: torch.Tensor) -> dict[str, str]:
    """The safetensors metadata holding the facts of states in host memory, measured here (the files
    other than the connector's that the pipeline writes: restored, synthetic)."""
    m = measured(states)
    return {FACTS_KEY: written_facts(states, m[:, 0], m[:, 1])}


def capture_facts(sample_id: str, path: str, expected: Expected) -> list[dict]:
    """StatesManifest rows of a file that passed the file contract: one per capture, measured.

    Streamed block by block of tokens: per token and capture the `measure`, and the CRC continued."""
    with open(path, "rb", buffering=0) as f:
        states = _open_states(f, path)
        tokens, n, hidden = states.shape
        norms, low, crcs = torch.empty(tokens, n), torch.empty(tokens, n, dtype=_BITS[states.dtype][0]), [0] * n
        step = max(1, _BLOCK_BYTES // (n * hidden * states.element_size()))  # small, reused temporaries
        # The next block is read while this one is measured; closed (the read finished) before f is.
        with contextlib.closing(ahead(_read_blocks(f, states, step, path))) as blocks:
            for start in blocks:
                block = states[start : start + step]
                norms[start : start + step], low[start : start + step] = measure(block)
                crcs = [_crc(block[:, slot], crc) for slot, crc in enumerate(crcs)]
    return manifest_rows(sample_id, path, slot_facts(states, norms, low, crcs), expected)
