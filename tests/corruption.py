"""Corrupting a finished demo run's real files, re-running the workflow on them, and reading the verdict.

Shared by the corruption catalogue and the validation tests. A re-run removes the corrupted shards'
validated outputs and the packed dataset first: validate then re-checks exactly those shards (the
states store is not a declared input, so nothing else would make it look again), and any dataset found
afterwards was packed by that re-run. Re-runs judge by file times only (`ONLY_MTIME`): a copied run
has no metadata, and a script edited since the session's demo run must not re-extract every shard.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import datasets
import pandas as pd
import torch
from conftest import demo_config, run_snakemake
from safetensors.torch import load_file, save_file

RUN = "results/demo"
ONLY_MTIME = ("--rerun-triggers", "mtime")


@dataclass(frozen=True)
class Sample:
    sample_id: str
    shard: str
    path: Path  # its states file in the run's store
    num_tokens: int

    def states(self) -> dict[str, torch.Tensor]:
        return load_file(str(self.path))

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.path))

    def with_states(self, states: torch.Tensor) -> None:
        """Replace `hidden_states`, keeping the file's token ids."""
        self.write({**self.states(), "hidden_states": states})


def samples(run: Path, shard: str) -> list[Sample]:
    """The shard's samples, without the one the demo input holds twice (it is in two shards)."""
    tokenized = {s: pd.read_parquet(run / RUN / f"tokenized/shard-{s}.parquet")
                 for s in ("00000", "00001", "00002")}
    counts = pd.concat(tokenized.values())["sample_id"].value_counts()
    manifest = pd.read_parquet(run / RUN / f"extract/shard-{shard}.parquet").set_index("sample_id")
    return [Sample(row.sample_id, shard, run / manifest.loc[row.sample_id, "path"], int(row.num_tokens))
            for row in tokenized[shard].itertuples() if counts[row.sample_id] == 1]


@contextmanager
def table(path: Path, keep_mtime: bool = False):
    """Edit a parquet table in place; `keep_mtime` leaves its timestamp alone, so Snakemake does not
    re-run its producer's consumers for it (the corruption happened after they ran)."""
    stat = path.stat()
    frame = pd.read_parquet(path)
    yield frame
    frame.to_parquet(path, index=False)
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def rerun(run: Path, *shards: str, policy: str = "fail") -> subprocess.CompletedProcess:
    for shard in shards:
        for suffix in ("parquet", "quarantined.parquet"):
            (run / RUN / f"validated/shard-{shard}.{suffix}").unlink(missing_ok=True)
    shutil.rmtree(run / RUN / "dataset", ignore_errors=True)
    (run / RUN / "dataset.counts.json").unlink(missing_ok=True)
    return run_snakemake(run, *ONLY_MTIME, config=demo_config(validation={"policy": policy}), check=False)


def validate_log(run: Path, shard: str) -> str:
    return (run / RUN / f"logs/validate/shard-{shard}.log").read_text()


def packed_ids(run: Path) -> set[str]:
    """Sample ids in the packed dataset; empty when none was packed."""
    path = run / RUN / "dataset"
    return set(datasets.load_from_disk(str(path))["sample_id"]) if path.exists() else set()


def failure_line(text: str, sample_id: str, check: str) -> str:
    """The line of a failure summary for this sample and check (fails the test if there is none)."""
    lines = [line for line in text.splitlines() if f"sample {sample_id} | check {check}" in line]
    assert lines, f"no failure line for sample {sample_id}, check {check!r} in:\n{text[-6000:]}"
    return lines[0]


def assert_refused(proc: subprocess.CompletedProcess, run: Path, shard: str,
                   expectations: list[tuple[str, str, str]]) -> str:
    """The run failed in validate of `shard`, its log names each (sample, check, found) under a header
    counting the failed samples, and nothing was packed. Returns the log."""
    assert proc.returncode != 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Error in rule validate" in proc.stdout + proc.stderr
    log = validate_log(run, shard)
    failed = {sample_id for sample_id, _, _ in expectations}
    assert re.search(rf": {len(failed)} of \d+ sample\(s\)", log) and "Files to look at:" in log, log[-3000:]
    for sample_id, check, found in expectations:
        line = failure_line(log, sample_id, check)
        assert "| expected " in line and f"| found {found}" in line, line
    assert not (run / RUN / "dataset").exists()
    assert not failed & packed_ids(run)
    return log
