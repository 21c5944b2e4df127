"""What every trainer export shares: a staging directory renamed into place, and a manifest.

An export is built in a hidden temporary directory beside its destination and renamed into place only
when complete (`store.atomic_path`), so a crash never leaves an export a trainer would read as whole. It
never overwrites: an existing destination is refused. `eagle3_export.json` records what was written, from
which dataset, and the trainer settings that match it (layer ids in the trainer's convention, final-state
norm, hidden size, dtype, draft vocabulary size).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from eagle3data.dataset.format import PackedDataset, open_dataset
from eagle3data.storage.store import atomic_path
from eagle3data.exports.trainers import ExportRefused, Layout

MANIFEST_FILE = "eagle3_export.json"
# How an export holds the states: written out as the trainer reads them, or read from the packed dataset
# by this project's reader for that trainer (speculators_reader.py, specforge_reader.py: they import the
# trainers' code; the exports do not).
STATES = ("files", "reader")
# speculators' --hidden-states-backend that reads the packed states in place; also the manifest's
# `hidden_states_backend` of every reader export.
READER_BACKEND = "eagle3data"


def check_states(states: str) -> None:
    if states not in STATES:
        raise ExportRefused(f"--states: expected one of {STATES}, found {states!r}")


class ReaderMismatch(RuntimeError):
    """A reader export that is not one, or whose packed dataset is no longer the one exported."""


def read_reader_manifest(export_dir: Path) -> dict:
    """The manifest of an export written with --states reader (refused otherwise)."""
    manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
    if manifest.get("hidden_states_backend") != READER_BACKEND:
        raise ReaderMismatch(f"{export_dir}: expected an export written with --states reader, found "
                             f"hidden_states_backend {manifest.get('hidden_states_backend')!r}")
    return manifest


def open_exported_dataset(export_dir: Path, manifest: dict) -> PackedDataset:
    """The packed dataset a reader export was made from, refused when its fingerprint or sample count
    is not the exported one."""
    source = manifest["source"]
    ds = open_dataset(source["dataset"])
    found = (ds.metadata["fingerprint"], len(ds))
    if found != (source["fingerprint"], manifest["samples"]):
        raise ReaderMismatch(
            f"{export_dir}: made from {source['dataset']} with fingerprint {source['fingerprint']} and "
            f"{manifest['samples']} samples, found {found[0]} and {found[1]}: export again")
    return ds


@contextlib.contextmanager
def staging_dir(out: str | Path) -> Iterator[Path]:
    """A fresh directory that becomes `out` if the block succeeds; `out` must not exist yet."""
    out = Path(out)
    if out.exists():
        raise ExportRefused(f"{out}: expected no such path (exports never overwrite), found one; remove it")
    with atomic_path(out) as tmp:
        Path(tmp).mkdir()
        yield Path(tmp)


def write_manifest(directory: Path, ds: PackedDataset, lay: Layout, draft_vocab_size: int, **extra) -> dict:
    meta = ds.metadata
    n_layers = meta["model"]["num_hidden_layers"]
    manifest = {
        "trainer": lay.trainer.name,
        "samples": len(ds),
        "layer_ids": lay.layer_ids,
        "layer_ids_setting": lay.trainer.layer_ids_setting,
        "layer_id_convention": lay.trainer.convention(n_layers),
        "aux_slots": lay.aux_slots,
        "aux_captures": [meta["captures"][s]["name"] for s in lay.aux_slots],
        "final_state": lay.trainer.final_state,
        "final_state_source": meta["captures"][lay.final_slot]["name"],
        "hidden_size": meta["hidden_size"],
        "dtype": meta["dtype"],
        "draft_vocab_size": draft_vocab_size,
        "source": {"dataset": str(ds.path), "fingerprint": meta["fingerprint"], "model": meta["model"]},
        **extra,
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return manifest
