"""The dtypes a run captures states in (config/schema.yaml's `model.dtype` choices), by name: the one table
the contracts, the store's readers and the packed dataset's format look a dtype up in, so a dtype is added
or refused in one place. numpy and Arrow have no bfloat16: they hold its values as their 16-bit patterns,
which torch views as bfloat16 again. No torch here: pack and validate's header checks start without it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StateDtype(NamedTuple):
    header: str  # its name in a safetensors header
    storage: np.dtype  # what numpy and Arrow hold its values as
    exponent: int  # its exponent bits, all set: a value that has them is inf or nan


DTYPES = {"bfloat16": StateDtype("BF16", np.dtype(np.uint16), 0x7F80),
          "float32": StateDtype("F32", np.dtype(np.float32), 0x7F800000)}
STORAGE = {name: d.storage for name, d in DTYPES.items()}
ITEMSIZES = {name: d.storage.itemsize for name, d in DTYPES.items()}  # bytes a value
# A header's dtype as the config names it; float16 too, which no run captures, so that a float16 file is
# refused by that name.
HEADER_NAMES = {"F16": "float16"} | {d.header: name for name, d in DTYPES.items()}
