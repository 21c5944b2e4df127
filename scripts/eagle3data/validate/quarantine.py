"""Quarantine: failing samples' states files set aside with a reason file, so the rest can be packed.

Used by `validate` under `validation.policy: quarantine`. Each failing sample's file moves out of the
store to `<directory>/<sample id>.safetensors`, beside `<sample id>.reason.txt` (its failures, one per
line), and the sample is recorded as skipped with reason `quarantined: <checks>`, so pack's counts
reconcile and the report shows it. Nothing is dropped silently, and nothing is deleted: the file stays
for inspection. The reason files are inputs of the shard's extract job (rules/extract.smk), newer than
its outputs now, so the next run re-runs extract for the shard, which recomputes exactly the samples
whose files are gone from the store, and validates them again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

import pandas as pd

from eagle3data.contracts.failures import Failure
from eagle3data.contracts.schemas import SkippedShard, check
from eagle3data.storage.store import STATES_SUFFIX, atomic_path, atomic_write_text


def quarantine(found: list[Failure], tokenized: pd.DataFrame, paths: dict[str, str],
               directory: str) -> pd.DataFrame:
    """Set aside the samples of `found`; return their SkippedShard rows."""
    by_sample: dict[str, list[Failure]] = {}
    for failure in found:
        by_sample.setdefault(failure.sample_id, []).append(failure)
    source = tokenized.set_index("sample_id")
    rows = []
    for sample_id, failures in by_sample.items():
        reason_file = Path(directory) / f"{sample_id}.reason.txt"
        atomic_write_text(reason_file, "".join(f"{f}\n" for f in failures))
        with contextlib.suppress(FileNotFoundError):  # unreadable because missing, or already moved
            _move(Path(paths[sample_id]), Path(directory) / f"{sample_id}{STATES_SUFFIX}")
        checks = "; ".join(dict.fromkeys(f.check for f in failures))
        rows.append(
            {
                "sample_id": sample_id,
                "source_row": source.loc[sample_id, "source_row"],
                "source_id": source.loc[sample_id, "source_id"],
                "reason": f"quarantined: {checks} (see {reason_file})",
            }
        )
    columns = list(SkippedShard.to_schema().columns)
    return check(SkippedShard, pd.DataFrame(rows, columns=columns), f"quarantined samples in {directory}")


def _move(source: Path, target: Path) -> None:
    """Rename; across filesystems (a file on storage.transport_dir's RAM disk) copy whole under a
    temporary name, then remove (shutil.move would copy straight to `target`: a crash could leave a
    partial file there)."""
    try:
        os.replace(source, target)
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise
        with atomic_path(target) as tmp:
            shutil.copyfile(source, tmp)
        source.unlink()
