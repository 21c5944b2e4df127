"""What a per-sample states file holds, read into the facts that the contracts in schemas.py judge.

A file must hold exactly `hidden_states [T, n_captures, H]` (the configured dtype) and `token_ids [T]`, as
vLLM's hidden-states connector writes them. `file_facts` reads the header and the token ids only (cheap);
`capture_facts` reads the states and measures each capture (non-finite values, zeros, checksum). Neither
judges: the contracts do, so a list of 771 `[512]` tensors where one `[T, 4, H]` tensor belongs (the bug
this project was born from) fails in one place, saying what was expected and what was found.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pandas as pd
import torch
from safetensors import safe_open

from eagle3data.failures import validate
from eagle3data.layers import Capture
from eagle3data.schemas import StatesFile, states_file_contract

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


@dataclass(frozen=True)
class Expected:
    captures: list[Capture]
    hidden_size: int
    dtype: str

    def file_contract(self) -> type[StatesFile]:
        return states_file_contract(len(self.captures), self.hidden_size, self.dtype)


def file_facts(sample_id: str, path: str, input_ids) -> dict:
    """A StatesFile row: the file's tensor names, states shape and dtype, and token ids, as found."""
    facts = {"sample_id": sample_id, "path": str(path), "read_error": "", "tensors": [], "shape": [],
             "dtype": "", "token_ids": [], "input_ids": [int(i) for i in input_ids]}
    try:
        with safe_open(path, framework="pt") as f:
            facts["tensors"] = sorted(f.keys())
            if "hidden_states" in facts["tensors"]:
                states = f.get_slice("hidden_states")
                facts["shape"] = list(states.get_shape())
                facts["dtype"] = _SAFETENSORS_DTYPES.get(states.get_dtype(), states.get_dtype())
            if "token_ids" in facts["tensors"]:
                facts["token_ids"] = f.get_tensor("token_ids").tolist()
    except Exception as exc:  # missing, truncated, not safetensors
        facts["read_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def header_problems(sample_id: str, path: str, expected_ids, expected: Expected) -> list[str]:
    """The file contract on one sample (header and token ids only): [] when the file is a whole,
    matching result, else one line per failed check naming the sample, expected and found."""
    frame = pd.DataFrame([file_facts(sample_id, path, expected_ids)])
    return [str(f) for f in validate(expected.file_contract(), frame, str(path))[1]]


def checksum(x: torch.Tensor) -> str:
    """CRC32 of a tensor's bytes: recorded by validate, compared by pack when it reads the file again."""
    return f"{zlib.crc32(x.contiguous().view(torch.uint8).numpy()):08x}"


def load_states(path: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor("hidden_states")


def capture_facts(sample_id: str, path: str, expected: Expected) -> list[dict]:
    """StatesManifest rows of a file that passed the file contract: one per capture, measured."""
    states = load_states(path)
    rows = []
    for slot, capture in enumerate(expected.captures):
        x = states[:, slot, :]
        nonfinite = int((~torch.isfinite(x)).sum())
        zero = x == 0
        rows.append(
            {
                "sample_id": sample_id,
                "capture": capture.name,
                "slot": slot,
                "rows": x.shape[0],
                "hidden_size": x.shape[1],
                "dtype": expected.dtype,
                "nbytes": x.numel() * x.element_size(),
                "nonfinite": nonfinite,
                "zero_fraction": float(zero.float().mean()),
                "zero_rows": int(zero.all(dim=-1).sum()),
                "identical_rows": x.shape[0] > 1 and bool((x == x[:1]).all()),
                "mean_norm": float(x.float().norm(dim=-1).mean()) if not nonfinite else float("nan"),
                "checksum": checksum(x),
                "path": str(path),
            }
        )
    return rows
