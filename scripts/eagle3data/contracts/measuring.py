"""The tensor side of a states file: measuring the facts validate judges (per capture: non-finite
values, zeros, zero and identical rows, mean norm, CRC32), for the connector as it writes a file
(`measured` on the GPU, `written_facts` on the host copy) and for validate when a file's header holds no
facts (`capture_facts`). One function computes each fact for all of them, so the facts in a header and
the facts measured from the file are equal bit for bit; the reads and the CRCs are reading.py's, which
pack uses without torch to compare every byte it packs with the CRCs validate recorded. `save_states`
writes a file as the connector does (raw or compressed).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3data.contracts import reading
from eagle3data.contracts.dtypes import DTYPES
from eagle3data.utils.overlap import ahead
from eagle3data.contracts.states import FACTS_KEY, Expected, manifest_rows

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
# Each dtype as integers of its width, and its exponent bits (all set: inf or nan).
_BITS = {TORCH_DTYPES[name]: (getattr(torch, f"int{8 * d.storage.itemsize}"), d.exponent)
         for name, d in DTYPES.items()}
_BLOCK_BYTES = 2 << 20  # capture_facts reads and measures this many bytes of tokens at a time


def _numpy(x: torch.Tensor) -> np.ndarray:
    """x's memory as numpy holds it (dtypes.STORAGE: bfloat16 as its 16-bit patterns), not copied."""
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _crc(x: torch.Tensor, value: int = 0) -> int:
    return reading.crc(_numpy(x), value)


def _read_blocks(f, states: np.ndarray, step: int, path: str, read: bool) -> Iterator[int]:
    """Read the states from `f` block by block of `step` tokens (unless `read`: already there); yield each
    block's first token once read."""
    for start in range(0, states.shape[0], step):
        if not read:
            reading.read_into(f, reading.as_bytes(states[start : start + step]), path)
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
    value bits are zero. Real states have none, and then a few operations over all captures at once
    settle it (the connector's writer threads run this for every file, holding Python's lock)."""
    tokens, n, hidden = states.shape
    suspect = not bool(torch.isfinite(norms).all()) or bool((low == 0).any())
    # Rows 0 and 1 first: for real states that settles identical rows without comparing every row.
    first_equal = (states[1] == states[0]).all(dim=-1).tolist() if tokens > 1 else [False] * n
    facts = []
    for slot in range(n):
        x = states[:, slot, :]
        nonfinite, zeros, zero_rows = _value_counts(x, norms[:, slot], low[:, slot]) if suspect else (0, 0, 0)
        facts.append({
            "rows": tokens,
            "hidden_size": hidden,
            "nbytes": x.numel() * x.element_size(),
            "nonfinite": nonfinite,
            "zero_fraction": float(np.float32(zeros) / np.float32(x.numel())),  # as float32 mean()
            "zero_rows": zero_rows,
            "identical_rows": first_equal[slot] and bool((x == x[:1]).all()),
            # A column's own mean: a mean over dim 0 sums in another order (other last bits).
            "mean_norm": float(norms[:, slot].contiguous().mean()) if not nonfinite else float("nan"),
            "checksum": f"{crcs[slot]:08x}",
        })
    return facts


def _value_counts(x: torch.Tensor, norm: torch.Tensor, low: torch.Tensor) -> tuple[int, int, int]:
    """One capture's non-finite values, zero values and all-zero rows, looking only at the suspect rows."""
    exponent = _BITS[x.dtype][1]
    return (int((_magnitudes(x, ~torch.isfinite(norm)) >= exponent).sum()),
            int((_magnitudes(x, low == 0) == 0).sum()),
            int((_magnitudes(x, norm == 0) == 0).all(dim=-1).sum()))


_scratch = threading.local()  # per writer thread: one capture's bytes, for its CRC


def _thread_buffer(like: np.ndarray) -> np.ndarray:
    """Memory of like's shape and dtype, this thread's own and reused (grown to the longest capture)."""
    held = getattr(_scratch, "bytes", None)
    if held is None or held.size < like.nbytes:
        held = _scratch.bytes = np.empty(like.nbytes, np.uint8)
    return held[: like.nbytes].view(like.dtype).reshape(like.shape)


def written_facts(states: torch.Tensor, norms: torch.Tensor, low: torch.Tensor) -> str:
    """The facts of the states about to be written (host memory) for the file's header (FACTS_KEY). In
    the connector's writer threads: each capture is copied for its CRC into a buffer the thread reuses
    (the row-by-row CRC holds Python's lock, which vLLM's engine thread needs, 2,048 times a sample; a
    new copy per capture costs an allocation and its page faults, and made 8 threads slower than one)."""
    values = _numpy(states)
    buffer = _thread_buffer(values[:, 0])
    crcs = []
    for slot in range(values.shape[1]):
        np.copyto(buffer, values[:, slot])
        crcs.append(reading.crc(buffer))
    return json.dumps(slot_facts(states, norms, low, crcs))


def facts_header(states: torch.Tensor) -> dict[str, str]:
    """The safetensors metadata holding the facts of states in host memory, measured here (the files
    other than the connector's that the pipeline writes: restored, synthetic)."""
    m = measured(states)
    return {FACTS_KEY: written_facts(states, m[:, 0], m[:, 1])}


def save_states(path: str, states: torch.Tensor, token_ids: torch.Tensor, metadata: dict[str, str]) -> None:
    """A states file as the connector writes it: `hidden_states` and `token_ids` with `metadata` (the facts)."""
    save_file({"hidden_states": states.contiguous(), "token_ids": token_ids}, path, metadata=metadata)


def load_stored(path: str) -> dict[str, torch.Tensor]:
    """A states file's `hidden_states` (its dtype, decompressed where the file is compressed) and
    `token_ids`, as `save_states` wrote them."""
    array, dtype, _ = reading.read_states(path)
    with safe_open(path, framework="pt") as f:
        token_ids = f.get_tensor("token_ids")
    return {"hidden_states": torch.from_numpy(array).view(TORCH_DTYPES[dtype]), "token_ids": token_ids}


def capture_facts(sample_id: str, path: str, expected: Expected) -> list[dict]:
    """StatesManifest rows of a file that passed the file contract: one per capture, measured.

    Streamed block by block of tokens: per token and capture the `measure`, and the CRC continued."""
    with open(path, "rb", buffering=0) as f:
        array, dtype, stored = reading.open_states(f, path)  # a compressed file: decoded whole
        states = torch.from_numpy(array).view(TORCH_DTYPES[dtype])
        tokens, n, hidden = states.shape
        norms, low, crcs = torch.empty(tokens, n), torch.empty(tokens, n, dtype=_BITS[states.dtype][0]), [0] * n
        step = max(1, _BLOCK_BYTES // (n * hidden * states.element_size()))  # small, reused temporaries
        # The next block is read while this one is measured; closed (the read finished) before f is.
        with contextlib.closing(ahead(_read_blocks(f, array, step, path, stored is not None))) as blocks:
            for start in blocks:
                block = states[start : start + step]
                norms[start : start + step], low[start : start + step] = measure(block)
                crcs = [_crc(block[:, slot], crc) for slot, crc in enumerate(crcs)]
    return manifest_rows(sample_id, path, slot_facts(states, norms, low, crcs), expected)
