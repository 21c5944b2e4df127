"""What a per-sample states file holds, read into the facts that the contracts in schemas.py judge.

A file must hold exactly `hidden_states [T, n_captures, H]` (the configured dtype) and `token_ids [T]`, as
vLLM's hidden-states connector writes them (compressed: `hidden_states_frame` and the metadata saying
which states it holds, storage/compression.py; judged as those states). `file_facts` reads the header and the token ids only (cheap);
`measuring.capture_facts` reads the states and measures each capture (non-finite values, zeros,
checksum). Neither judges: the contracts do, so a list of 771 `[512]` tensors where one `[T, 4, H]`
tensor belongs (the bug this project was born from) fails in one place, saying what was expected and
what was found.

Our connector measures the same facts while it writes a file (`measuring.written_facts`: the norms and
least bits on the GPU, the rest from the host copy it writes) and keeps them in the file's safetensors
header, so validate need not read the states again (`header_facts`); pack, which reads every byte
anyway, compares the checksums, so bytes changed after the write are still refused. A file without them
(written by anything else) is measured. This module needs no torch (the tensor code is measuring.py): a
validate job that judges headers only starts without it (~5 s of imports on a GPU node).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd
from safetensors import safe_open

from eagle3data.contracts.dtypes import HEADER_NAMES, ITEMSIZES
from eagle3data.contracts.failures import validate
from eagle3data.contracts.layers import Capture
from eagle3data.contracts.schemas import (
    BoundaryError,
    SampleStates,
    StatesFile,
    StatesManifest,
    sample_states_contract,
    states_file_contract,
    states_manifest_contract,
)
from eagle3data.storage.compression import FRAME_KEY, FRAME_TENSOR

FACTS_KEY = "eagle3data.capture_facts"  # the safetensors metadata entry of `measuring.written_facts`
SLOT_FACTS = ("rows", "hidden_size", "nbytes", "nonfinite", "zero_fraction", "zero_rows", "identical_rows",
              "mean_norm", "checksum")


@dataclass(frozen=True)
class Expected:
    """What each states file of a run holds: these captures, slot by slot, each `hidden_size` wide in
    `dtype`. Extract and validate judge files by it, pack reads them by it (from the dataset's metadata)."""

    captures: list[Capture]
    hidden_size: int
    dtype: str

    @classmethod
    def from_metadata(cls, meta: dict) -> Expected:
        """The states a dataset's metadata (config.settings.Settings.dataset_metadata) says its rows hold."""
        captures = [Capture(c["decoder_layer"], c["point"]) for c in meta["captures"]]
        return cls(captures, meta["hidden_size"], meta["dtype"])

    @property
    def token_bytes(self) -> int:
        """The raw state bytes of one token: every capture's values in the storage dtype."""
        return len(self.captures) * self.hidden_size * ITEMSIZES[self.dtype]

    def file_contract(self) -> type[StatesFile]:
        return states_file_contract(len(self.captures), self.hidden_size, self.dtype)

    def manifest_contract(self) -> type[StatesManifest]:
        """A states manifest's rows (one a capture of a sample) of these states."""
        return states_manifest_contract(self.hidden_size, self.dtype)

    def samples_contract(self) -> type[SampleStates]:
        """Each sample's captures in a manifest: exactly these, in slot order."""
        return sample_states_contract(tuple(c.name for c in self.captures))


def file_facts(sample_id: str, path: str, input_ids) -> dict:
    """A StatesFile row: the file's tensor names, states shape and dtype, and token ids, as found; and
    `written`, the facts the connector measured as it wrote the file ("" if none)."""
    facts = {"sample_id": sample_id, "path": str(path), "read_error": "", "tensors": [], "shape": [],
             "dtype": "", "token_ids": [], "input_ids": [int(i) for i in input_ids], "written": ""}
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
            facts["written"] = metadata.get(FACTS_KEY, "")
            facts["tensors"] = sorted(f.keys())
            if "hidden_states" in facts["tensors"]:
                states = f.get_slice("hidden_states")
                facts["shape"] = list(states.get_shape())
                facts["dtype"] = HEADER_NAMES.get(states.get_dtype(), states.get_dtype())
            elif FRAME_TENSOR in facts["tensors"]:  # compressed: the states the frame says it holds
                facts["tensors"] = sorted(["hidden_states" if k == FRAME_TENSOR else k for k in facts["tensors"]])
                about = json.loads(metadata.get(FRAME_KEY) or "{}")
                facts["shape"], facts["dtype"] = list(about.get("shape", [])), about.get("dtype", "")
            if "token_ids" in facts["tensors"]:
                facts["token_ids"] = f.get_tensor("token_ids").tolist()
    except Exception as exc:  # missing, truncated, not safetensors
        facts["read_error"] = f"{type(exc).__name__}: {exc}"
    return facts


def judge_files(facts: list[dict], expected: Expected) -> dict[str, list[str]]:
    """The file contract on many files' `file_facts` (headers and token ids): sample id -> one line per
    failed check naming the sample, expected and found; a whole, matching file has no entry. A failure of
    the table itself (our bug, never a sample's) raises. One table for all: a pandera validation per file
    costs ~5 ms, per 512 files ~20 ms, and the extract stage runs this inside its timed region."""
    if not facts:
        return {}
    problems: dict[str, list[str]] = {}
    table = pd.DataFrame(facts, columns=list(StatesFile.to_schema().columns))  # `written` is not judged here
    for failure in validate(expected.file_contract(), table, "states files")[1]:
        problems.setdefault(failure.sample_id, []).append(str(failure))
    if "-" in problems:
        raise BoundaryError("\n".join(problems["-"]))
    return problems


def header_facts(sample_id: str, path: str, written: str, shape: list[int], expected: Expected) -> list[dict] | None:
    """StatesManifest rows from the facts a file's header holds (`file_facts`' `written`), or None when
    it holds none that describe its `shape` (then the file is measured)."""
    try:
        slots = json.loads(written)
    except ValueError:
        return None
    if (not isinstance(slots, list) or len(shape) != 3 or len(slots) != shape[1]
            or any(not isinstance(f, dict) or set(f) != set(SLOT_FACTS) or f["rows"] != shape[0]
                   or f["hidden_size"] != shape[2] for f in slots)):
        return None
    return manifest_rows(sample_id, path, slots, expected)


def manifest_rows(sample_id: str, path: str, slots: list[dict], expected: Expected) -> list[dict]:
    return [{"sample_id": sample_id, "capture": capture.name, "slot": slot, "dtype": expected.dtype, **facts,
             "path": str(path)} for slot, (capture, facts) in enumerate(zip(expected.captures, slots))]
