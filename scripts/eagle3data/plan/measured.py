"""What the benchmark runs measured, read back to plan a user's run: the measurement index
(docs/measurements/index.csv, written by `python -m eagle3bench.table`), each figure's current
series, the measured run that supports a time estimate for a model, and the stored ratio of real states.
Preflight reads it for its disk and time lines; the benchmark's tables read it for the documentation.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from eagle3data.utils.checkout import REPO

MEASUREMENTS = REPO / "docs" / "measurements"
INDEX = MEASUREMENTS / "index.csv"
CPU = "2-core CPU"


@dataclass(frozen=True)
class Row:
    file: str
    date: str
    commit: str
    hardware: str
    figure: str
    value: float

    def cells(self) -> list[str]:
        return [self.file, self.date, self.commit, self.hardware, self.figure, f"{self.value:.6g}"]


def load(path: Path) -> object:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def read_index(path: Path = INDEX) -> list[Row]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [Row(r["file"], r["date"], r["commit"], r["hardware"], r["figure"], float(r["value"]))
                for r in csv.DictReader(f)]


def series_key(name: str) -> tuple[str, str, str]:
    """(date, letter, series name): `-runN` ends and the extension stripped."""
    stem = re.sub(r"\.json(\.gz)?$", "", name)
    m = re.match(r"(\d{4}-\d\d-\d\d)-[a-z0-9]+-(?:([a-z])-)?(.*)$", stem)
    date, letter, rest = m.group(1), m.group(2) or "", m.group(3)
    return date, letter, re.sub(r"-run\d+$", "", rest)


def current(rows: list[Row]) -> dict[tuple[str, str], list[Row]]:
    """(hardware, figure) -> the rows of its current series."""
    groups: dict[tuple[str, str], dict[tuple[str, str, str], list[Row]]] = {}
    for r in rows:
        groups.setdefault((r.hardware, r.figure), {}).setdefault(series_key(r.file), []).append(r)
    out = {}
    for key, series in groups.items():
        newest = max(k[:2] for k in series)
        candidates = [(len(v), max(x.date for x in v), v) for k, v in series.items() if k[:2] == newest]
        out[key] = max(candidates, key=lambda c: (c[0], c[1]))[2]
    return out


# The models the GPU kit and the CPU benchmark run, by the name of their directory: what a user compares
# their own model with (model.shapes builds them).
MODELS = {"llama-8b": {"name": "8B Llama shape", "hidden_size": 4096, "num_hidden_layers": 32,
                       "intermediate_size": 14336},
          "demo-model": {"name": "the demo model", "hidden_size": 128, "num_hidden_layers": 8,
                         "intermediate_size": 256}}


def model_of(data: dict) -> dict | None:
    name = Path(str((data.get("args") or {}).get("model") or "")).name
    return next((dict(shape, key=key) for key, shape in MODELS.items() if name.startswith(key)), None)


@dataclass(frozen=True)
class RunRate:
    """One benchmark run of the whole pipeline, in absolute terms."""

    hardware: str
    file: str
    model: dict
    tokens: int
    extract_tps: float  # the extract stage measured alone, same machine, same run
    steady_tps: float  # the engine ready to the last extract job's end
    dataset_tps: float  # the engine ready to the packed dataset
    whole_seconds: float  # the command to its end
    before_ready_seconds: float  # the command to the first engine ready: engine load, tokenize, job starts

    @property
    def fixed_seconds(self) -> float:
        """The whole run's seconds beyond its tokens at the rate to the packed dataset."""
        return self.whole_seconds - self.tokens / self.dataset_tps

    @property
    def hours_per_million(self) -> float:
        return 1e6 / self.dataset_tps / 3600


def run_rates(cur: dict[tuple[str, str], list[Row]]) -> list[RunRate]:
    """For each machine whose current series (`cur`, from current()) has a run of the whole pipeline: its
    slowest run to the packed dataset (the worst of the series)."""
    out = []
    for (hw, figure), rs in sorted(cur.items()):
        if figure != "7d":
            continue
        runs = []
        for r in rs:
            data = load(MEASUREMENTS / r.file)
            run, model = data["measurements"]["end_to_end"], model_of(data)
            if model is None:
                continue
            extract = data["measurements"]["extract"]["extract"]["tokens_per_second"]
            runs.append(RunRate(hw, r.file, model, run["tokens"], extract,
                                run["tokens"] / run["timeline"]["last_extract_end"],
                                run["tokens"] / run["seconds_from_engine_ready"], run["seconds"],
                                run["seconds"] - run["seconds_from_engine_ready_to_end_of_run"]))
        if runs:
            out.append(min(runs, key=lambda x: x.dataset_tps))
    return out


def measured_rate(device: str, model: dict, tensor_parallel: int, codec: str = "zstd") -> RunRate | None:
    """The measured run that supports a time estimate for `model` (its config's hidden_size,
    num_hidden_layers, intermediate_size) on `device` ("cpu", or a GPU's name) storing states with `codec`,
    or None: only the same shape at TP1 on the same kind of machine; of several, the codec's (else any
    that names one), the slowest."""
    if tensor_parallel != 1:
        return None
    kinds = [k for k in ("H100", "H200") if k in device.upper()] if device != "cpu" else ["CPU"]
    shape = ("hidden_size", "num_hidden_layers", "intermediate_size")
    fits = [r for r in run_rates(current(read_index())) if any(k in r.hardware for k in kinds)
            and all(model.get(k) == r.model[k] for k in shape)]
    named = [r for r in fits if "CPU" in r.hardware or r.hardware.endswith(("raw", "zstd"))]
    fits = [r for r in named if r.hardware.endswith({"none": "raw"}.get(codec, codec))] or named
    return min(fits, key=lambda r: r.dataset_tps, default=None)


# storage.compression.precision -> the index's figure of the packed dataset's bytes / raw bf16 bytes of real states
STORED_FIGURES = {"exact": "6", "fp8_e4m3": "6f"}


def stored_ratio(cur: dict[tuple[str, str], list[Row]] | None = None, precision: str = "exact") -> float:
    """The packed dataset's bytes / raw bytes of real states with zstd at `precision`: the storage
    benchmark's worst (largest) current run, on the CPU where it runs; `cur` (from current()) or else the
    index on disk."""
    return max(r.value for r in (cur or current(read_index()))[(CPU, STORED_FIGURES[precision])])
