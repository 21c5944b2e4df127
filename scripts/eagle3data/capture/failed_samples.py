"""The failure record of an extract job: which samples of a shard failed, and why.

Snakemake deletes a failed job's declared outputs, so the record is not one of them: it lives beside the
shard's manifest as `extract/shard-NNNNN.failed.json`, is written atomically when any sample of the
shard fails, and is removed when the shard completes. The other samples' files stay in the store, so
the next run of the shard computes only the failed ones (and any it never reached). `rule retry_failed`
targets exactly the shards that have a record; the Snakefile's `onerror` prints every record.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3data.storage.store import atomic_write_text

SUFFIX = ".failed.json"


class SampleFailures(RuntimeError):
    """Some samples of a shard failed; their reasons (each naming its sample) are in the message."""


def record_path(manifest: str | Path) -> Path:
    """`extract/shard-NNNNN.parquet` -> `extract/shard-NNNNN.failed.json`."""
    manifest = Path(manifest)
    return manifest.with_name(manifest.stem + SUFFIX)


def describe(manifest: str | Path, shard: str, failed: dict[str, str], samples: int) -> str:
    """The job's error: how many of the shard's samples failed, where they are recorded, each reason."""
    lines = [
        f"shard {shard}: {len(failed)} of {samples} sample(s) failed (recorded in "
        f"{record_path(manifest)}); the other samples' states are kept in the store and reused by the "
        "next run, which computes only these (`snakemake retry_failed` retries nothing else):"
    ]
    return "\n".join(lines + [f"  {reason}" for reason in failed.values()])


def write(manifest: str | Path, shard: str, failed: dict[str, str], samples: int, reused: int) -> None:
    """Record `failed` (sample id -> reason) of the shard whose manifest is `manifest`, atomically."""
    doc = {
        "shard": shard,
        "samples": samples,
        "reused": reused,
        "failed": [{"sample_id": s, "reason": r} for s, r in failed.items()],
    }
    atomic_write_text(record_path(manifest), json.dumps(doc, indent=2))


def clear(manifest: str | Path) -> None:
    """The shard completed: its record, if any, no longer holds."""
    record_path(manifest).unlink(missing_ok=True)


def summary(extract_dir: str | Path) -> str:
    """Every record under `extract_dir`, one line per failed sample ("" when there is none)."""
    lines = []
    for record in sorted(Path(extract_dir).glob(f"shard-*{SUFFIX}")):
        doc = json.loads(record.read_text())
        lines += [f"  {record}: {f['reason']}" for f in doc["failed"]]
    if not lines:
        return ""
    header = (f"{len(lines)} sample(s) failed in extract; `snakemake retry_failed` computes only them "
              "(see docs/resume.md):")
    return "\n".join([header, *lines])
