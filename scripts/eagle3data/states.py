"""The per-sample states file contract, checked wherever a file is read.

A file holds exactly `hidden_states [T, n_captures, H]` (the configured dtype) and `token_ids [T]`, as
vLLM's hidden-states connector writes them. `inspect_states` reads one file and returns, per capture, the
facts the manifest records, plus every way the file breaks the contract, each naming the sample, what
was expected and what was found. A list of 771 `[512]` tensors where one `[T, 4, H]` tensor belongs
(the bug this project was born from) fails here, loudly.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from safetensors import safe_open

from eagle3data.layers import Capture

STATE_KEYS = ("hidden_states", "token_ids")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Expected:
    captures: list[Capture]
    hidden_size: int
    dtype: str


def header_problems(sample_id: str, path: str, expected_ids, expected: Expected) -> list[str]:
    """Cheap checks (header and token ids only): is this file a whole, matching result?"""
    try:
        with safe_open(path, framework="pt") as f:
            keys = sorted(f.keys())
            if keys != sorted(STATE_KEYS):
                shown = keys if len(keys) <= 6 else keys[:6] + [f"... ({len(keys)} tensors)"]
                return [
                    f"sample {sample_id}: file {path}: expected tensors {list(STATE_KEYS)}, "
                    f"found {shown}"
                ]
            shape = list(f.get_slice("hidden_states").get_shape())
            dtype = f.get_slice("hidden_states").get_dtype()
            token_ids = f.get_tensor("token_ids")
    except Exception as exc:  # truncated, not safetensors, unreadable
        return [f"sample {sample_id}: file {path} is unreadable: {type(exc).__name__}: {exc}"]
    problems = []
    n, hidden = len(expected.captures), expected.hidden_size
    rows = len(expected_ids)
    if shape != [rows, n, hidden]:
        problems.append(
            f"sample {sample_id}: hidden_states shape: expected [{rows}, {n}, {hidden}] "
            f"(tokens, captures, hidden), found {shape}"
        )
    want_dtype = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}[expected.dtype]
    if dtype != want_dtype:
        problems.append(f"sample {sample_id}: hidden_states dtype: expected {want_dtype}, found {dtype}")
    if token_ids.dim() != 1 or token_ids.tolist() != list(expected_ids):
        problems.append(
            f"sample {sample_id}: token_ids differ from the tokenized sample "
            f"(expected {rows} ids, found shape {list(token_ids.shape)}"
            f"{_first_difference(token_ids, expected_ids)})"
        )
    return problems


def _first_difference(found: torch.Tensor, expected) -> str:
    found = found.flatten().tolist()
    for i, (a, b) in enumerate(zip(found, expected)):
        if a != b:
            return f", first difference at position {i}: expected {b}, found {a}"
    return ""


def inspect_states(
    sample_id: str, path: str, expected_ids, expected: Expected
) -> tuple[list[dict], list[str]]:
    """Full check of one file: (one manifest row per capture, problems)."""
    problems = header_problems(sample_id, path, expected_ids, expected)
    if problems:
        return [], problems
    with safe_open(path, framework="pt") as f:
        states = f.get_tensor("hidden_states")
    rows = []
    for slot, capture in enumerate(expected.captures):
        x = states[:, slot, :]
        finite = bool(torch.isfinite(x).all())
        zero_fraction = float((x == 0).float().mean())
        if not finite:
            bad = int((~torch.isfinite(x)).sum())
            problems.append(f"sample {sample_id}: capture {capture.name}: {bad} NaN/Inf values")
        if zero_fraction == 1.0:
            problems.append(f"sample {sample_id}: capture {capture.name}: all values are zero")
        rows.append(
            {
                "sample_id": sample_id,
                "capture": capture.name,
                "slot": slot,
                "rows": x.shape[0],
                "hidden_size": x.shape[1],
                "dtype": expected.dtype,
                "nbytes": x.numel() * x.element_size(),
                "finite": finite,
                "zero_fraction": zero_fraction,
                "mean_norm": float(x.float().norm(dim=-1).mean()) if finite else float("nan"),
                "checksum": f"{zlib.crc32(x.contiguous().view(torch.uint8).numpy()):08x}",
                "path": path,
            }
        )
    return rows, problems
