"""What every trainer export shares: a staging directory renamed into place, and a manifest.

An export is built in a hidden temporary directory beside its destination and renamed into place only
when complete (`store.atomic_path`), so a crash never leaves an export a trainer would read as whole. It
never overwrites: an existing destination is refused. `eagle3_export.json` records what was written, from
which dataset, and the trainer settings that match it (layer ids in the trainer's convention, final-state
norm, hidden size, dtype, draft vocabulary size).

Every export carries checksums its readers verify. The manifest lists the CRC32 of each file beside it
that is not a per-row states file (`files_crc32`: speculators' table, token counts, vocabulary, final
norm); each per-row file states its own (speculators.py, specforge.py); a reader export's rows are the
packed dataset's, verified as `open_dataset` verifies them. This project's readers
(speculators_reader.py, specforge_reader.py) check them as they read, unless EAGLE3DATA_VERIFY=0.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from eagle3data.dataset.format import IntegrityError, PackedDataset, open_dataset, verifying
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
    manifest = read_manifest(export_dir)
    if manifest.get("hidden_states_backend") != READER_BACKEND:
        raise ReaderMismatch(f"{export_dir}: expected an export written with --states reader, found "
                             f"hidden_states_backend {manifest.get('hidden_states_backend')!r}")
    return manifest


FILES_CRC = "files_crc32"  # the manifest's key: {path relative to the export: CRC32 of the file's bytes}
CRC_READ = 16 << 20


def file_crc(path: Path) -> str:
    """The CRC32 of a file's bytes (zlib's values)."""
    from isal import isal_zlib

    value = 0
    with open(path, "rb") as f:
        while block := f.read(CRC_READ):
            value = isal_zlib.crc32(block, value)
    return f"{value:08x}"


def files_crc(directory: Path) -> dict[str, str]:
    """The CRC32s of every file under `directory` but the per-row states files (hidden_states/) and the
    manifest, by relative path."""
    return {str(p.relative_to(directory)): file_crc(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != MANIFEST_FILE and p.relative_to(directory).parts[0] != "hidden_states"}


def verify_export_files(export_dir: Path, manifest: dict) -> None:
    """The files the manifest lists have the CRC32s it states (skipped with EAGLE3DATA_VERIFY=0); an
    export written before checksums lists none."""
    if not verifying():
        return
    bad = [f"{name}: CRC32 {found} where the manifest states {want}" for name, want in manifest.get(FILES_CRC, {}).items()
           if (found := file_crc(export_dir / name) if (export_dir / name).is_file() else "missing") != want]
    if bad:
        raise IntegrityError(f"{export_dir}: files changed since the export was written: {'; '.join(bad)}. "
                             "Copy the export again from its source, or export again.")


def manifest_crc(manifest: dict) -> int:
    """The CRC32 of a manifest's content (without its own `manifest_crc32`), as written."""
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def read_manifest(export_dir: Path) -> dict:
    """An export's manifest, refused where it is not what the export wrote (its own CRC32)."""
    manifest = json.loads((export_dir / MANIFEST_FILE).read_text())
    if "manifest_crc32" in manifest and verifying() and manifest_crc(manifest) != manifest["manifest_crc32"]:
        raise IntegrityError(f"{export_dir / MANIFEST_FILE}: its content changed since the export was written "
                             f"(CRC32 {manifest_crc(manifest):08x}, stated {manifest['manifest_crc32']:08x})")
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
        FILES_CRC: files_crc(directory),
    }
    manifest["manifest_crc32"] = manifest_crc(manifest)
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return manifest
