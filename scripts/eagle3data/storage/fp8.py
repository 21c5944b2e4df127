"""Float8 e4m3 states with one scale per token (`storage.compression.precision: fp8_e4m3`): lossy, opt-in.

Why: the lossless frames store real states at ~0.71 of their raw bf16 bytes; one byte a value instead of
two halves that before compression. speculators stores its states this way (e4m3, a scale per token) and
reports draft acceptance within 0.05 of bf16 data. The price is precision, bounded below (`RELATIVE_ERROR`,
`ABSOLUTE_ERROR`), and the CPU of a conversion on every read.

Each token's hidden row of each capture (`H` values) is divided by its scale, the row's largest magnitude
/ 448 (e4m3's largest finite value) in float32, and rounded to the nearest e4m3 value
(`torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, no infinities). Reading multiplies the codes by
their scales in float32 and rounds once to the capture dtype. The arrays here are as numpy holds the
states (contracts.dtypes: bf16 as its 16-bit patterns); torch, whose float8 type does the rounding, is
imported on first use, so only an fp8 pack or read pays its import. storage/compression.py frames the codes
and scales.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np

E4M3_MAX = 448.0  # e4m3's largest finite magnitude: a token's largest value maps onto it
# The smallest scale: a token whose largest magnitude is below E4M3_MAX * SCALE_MIN (~3.5e-28, no model's
# state) is scaled as if it reached it, so that neither the scale nor a read value falls below float32's and
# bf16's normal range, and a token of zeros reads back as zeros.
SCALE_MIN = 2.0**-100
VALUE_DTYPES = {2: "bfloat16", 4: "float32"}  # the captured dtype by its values' size (contracts.dtypes.STORAGE)

RELATIVE_ERROR = 2**-4 + 2**-7
ABSOLUTE_ERROR = 2**-9 / E4M3_MAX
"""The bound every value read back from fp8 keeps against the value captured, x, in a token whose largest
magnitude (in that capture) is m:  |read - x| <= RELATIVE_ERROR * |x| + ABSOLUTE_ERROR * max(m, E4M3_MAX *
SCALE_MIN)  (`error_to_bound`). Why these: e4m3 keeps 4 significant bits, so rounding x / scale in e4m3's
normal range (>= 2^-6) errs by at most half a unit in the last place, 2^-4 of it; below that range its
subnormals lie 2^-9 apart, an error of at most 2^-10 * scale = 2^-10 / 448 * m. Reading rounds once more,
to bf16 (at most 2^-8 of the value, 2^-8 * (1 + 2^-4) of x), and float32's divisions and products add
about 2^-23: the relative constant leaves 2^-7 for these (2^-4 + 2^-8 * (1 + 2^-4) + 2^-22 < 2^-4 + 2^-7),
the absolute one twice the subnormal half-step. A value at least 2^-6 of its token's largest errs by at
most ~7 %; a smaller one by at most 2^-9 / 448 of the token's largest beyond that."""


@functools.cache
def _torch():
    import torch

    return torch


@functools.cache
def _codes_as_float16() -> np.ndarray:
    """Each of the 256 e4m3 codes as float16, which holds every e4m3 value exactly (torch's own conversion,
    once): a table lookup then reads codes ~4x faster than torch's float8 conversion."""
    torch = _torch()
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16).numpy()


def _values(states: np.ndarray):
    """The states as torch values (bf16 or float32), viewing the same memory (read, never written)."""
    torch = _torch()
    if states.dtype.itemsize not in VALUE_DTYPES:
        raise TypeError(f"fp8: states of {states.dtype} values; expected bf16 patterns (uint16) or float32")
    with warnings.catch_warnings():  # a read-only view of an Arrow buffer or a file, on purpose
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        values = torch.from_numpy(np.ascontiguousarray(states).view(f"i{states.dtype.itemsize}"))
    return values.view(getattr(torch, VALUE_DTYPES[states.dtype.itemsize]))


def quantize(states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """States `[L, n, H]` (bf16 patterns or float32) -> (their e4m3 codes `[L, n, H]` uint8, the float32
    scale of each token and capture `[L, n]`)."""
    torch = _torch()
    values = _values(states)
    scales = (values.abs().amax(-1, keepdim=True).float() / E4M3_MAX).clamp_min_(SCALE_MIN)
    codes = values.to(torch.float32, copy=True).div_(scales).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).numpy(), scales.squeeze(-1).numpy()


def dequantize(codes: np.ndarray, scales: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """e4m3 codes `[L, n, H]` and their scales `[L, n]` -> the values in `dtype` (bf16 patterns as uint16,
    or float32): code x scale in float32, rounded once to the dtype."""
    torch = _torch()
    values = torch.from_numpy(np.take(_codes_as_float16(), codes)).float()
    values.mul_(torch.from_numpy(np.array(scales, dtype=np.float32)).unsqueeze(-1))  # a copy: [L, n] is small
    if np.dtype(dtype).itemsize == 4:
        return values.numpy()
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def error_to_bound(captured: np.ndarray, read: np.ndarray) -> float:
    """The largest |read - captured| of any value over the bound it must keep (the docstring of
    RELATIVE_ERROR): at most 1 where every value keeps it. Both `[L, n, H]`, bf16 patterns or float32;
    computed in float32 (its rounding, ~2^-24 of a value, is far inside the bound's margin), in place where
    it can (pack checks every row with it)."""
    torch = _torch()
    values = _values(captured)
    if not values.numel():
        return 0.0
    floor = values.abs().amax(-1, keepdim=True).float().clamp_min_(E4M3_MAX * SCALE_MIN).mul_(ABSOLUTE_ERROR)
    x = values.to(torch.float32, copy=True)
    error = _values(read).to(torch.float32, copy=True).sub_(x).abs_()
    return float(error.div_(torch.add(floor, x.abs_(), alpha=RELATIVE_ERROR)).max())
