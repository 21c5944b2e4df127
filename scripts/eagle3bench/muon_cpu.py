"""Muon's Newton-Schulz step in bf16 at float32 speed, for CPUs without bf16 matrix instructions.

torch.optim.Muon orthogonalizes each update with five Newton-Schulz iterations in bf16. Where the CPU
has no AVX512-BF16 or AMX, torch multiplies bf16 matrices by a slow generic path: measured on a 2-core
AMD EPYC (AVX2 only), one 1536 x 576 update took 4.6 s instead of 0.1 s, and speculators' default
optimizer turned figure 8's quick draft training from ~1 s into 17-30 s a step (CI ran out of time).

`newton_schulz_bf16_via_float32` keeps the bf16 numerics (bf16 operands, float32 accumulation, each
product and sum rounded to bf16 once, as the bf16 kernels do) and multiplies in float32; results differ
from the bf16 kernels only by summation order. `use_where_bf16_is_slow` installs it on such CPUs only.
"""

from __future__ import annotations

import torch
from torch.optim import _muon


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def newton_schulz_bf16_via_float32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float],
                                   ns_steps: int, eps: float) -> torch.Tensor:
    """torch.optim._muon._zeropower_via_newtonschulz's iteration, each bf16 op as float32 then rounded."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = _bf16(grad.T if tall else grad)
    x = _bf16(x / _bf16(x.norm()).clamp(min=eps))
    for _ in range(ns_steps):
        gram = _bf16(x @ x.T)
        update = _bf16(torch.addmm(gram, gram, gram, beta=b, alpha=c))
        x = _bf16(torch.addmm(x, update, x, beta=a))
    return (x.T if tall else x).to(torch.bfloat16)


def bf16_matmul_is_native() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def use_where_bf16_is_slow() -> bool:
    """Route Muon's Newton-Schulz step through float32 on this CPU if it lacks bf16 instructions;
    whether it did."""
    if bf16_matmul_is_native():
        return False
    _muon._zeropower_via_newtonschulz = newton_schulz_bf16_via_float32
    return True
