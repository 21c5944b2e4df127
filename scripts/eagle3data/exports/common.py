"""What every trainer export shares: a staging directory renamed into place, and a manifest.

An export is built in a hidden temporary directory beside its destination and renamed into place only
when complete (`store.atomic_path`), so a crash never leaves an export a trainer would read as whole. It
never overwrites: an existing destination is refused. `eagle3_export.json` records what was written, from
which dataset, and the trainer settings that match it (layer ids in the trainer's convention, final-state
norm, hidden size, dtype, draft vocabulary size).

What an export costs on disk: by default (`states: reader`) the trainer reads the packed dataset in
place and the export holds only its small files (speculators' table, SpecForge's pointers, the
vocabulary, the manifest); `states: files` writes the states again, decompressed, as the trainer's own
reader loads them. Before writing, an export logs both costs (`plan.disk.describe_export`) and checks the
free space for its own (`storage.check_free_space`, `storage.reserve_gib`); after, the bytes it took.
The run's `token_freq.pt` and `vocab_mapping.pt` are hard links where the filesystem allows (rule vocab
replaces them, never changes them in place), copies otherwise.

Every export carries checksums its readers verify. The manifest lists the CRC32 of each file beside it
that is not a per-row states file (`files_crc32`: speculators' table, token counts, vocabulary, final
norm); each per-row file states its own (speculators.py, specforge.py); a reader export's rows are the
packed dataset's, verified as `open_dataset` verifies them. This project's readers
(speculators_reader.py, specforge_reader.py) check them as they read, unless EAGLE3DATA_VERIFY=0.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

from eagle3data.dataset.format import IntegrityError, PackedDataset, open_dataset, torch_dtype, verifying
from eagle3data.plan import disk
from eagle3data.storage import room
from eagle3data.storage.store import atomic_path
from eagle3data.utils.logs import get_logger
from eagle3data.exports.trainers import ExportRefused, Layout

MANIFEST_FILE = "eagle3_export.json"
logger = get_logger(__name__)
# How an export holds the states: read from the packed dataset by this project's reader for that trainer
# (speculators_reader.py, specforge_reader.py: they import the trainers' code; the exports do not), the
# default, or written out as the trainer's own reader loads them.
STATES = ("reader", "files")
DEFAULT_STATES = "reader"
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


def link_or_copy(source: str | Path, target: Path) -> None:
    """`target` a hard link to `source`, or a copy where the filesystem cannot link."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def export_shape(ds: PackedDataset, n_states: int, small_files_bytes: int = 0) -> disk.ExportShape:
    """The packed dataset's rows and tokens, and the states a trainer reads per token."""
    import pyarrow.compute as pc

    tokens = pc.sum(ds.hf.data.table.column("seq_len")).as_py() or 0
    return disk.ExportShape(samples=len(ds), tokens=int(tokens), states_per_token=n_states,
                            hidden_size=ds.metadata["hidden_size"],
                            itemsize=torch_dtype(ds.metadata["dtype"]).itemsize, small_files_bytes=small_files_bytes)


def own_bytes(*roots: Path) -> int:
    """Bytes on disk under `roots` (allocated blocks), each file once however many names it has."""
    seen, total = set(), 0
    for root in roots:
        for path in Path(root).rglob("*"):
            st = path.lstat()
            if path.is_file() and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def plan_disk(ds: PackedDataset, trainer: str, states: str, shape: disk.ExportShape, out: Path,
              storage: dict | None, linked: bool = False) -> int:
    """Log what the export costs (and what the other `states` would), and refuse (or warn, as
    `storage.check_free_space` says) where the destination's disk has less free than that and
    `storage.reserve_gib` (no `storage`: the cost alone, refused); return the dataset's bytes."""
    storage = {"reserve_gib": 0, "check_free_space": True, **(storage or {})}
    dataset_bytes = own_bytes(ds.path)
    logger.info("%s", disk.describe_export(trainer, states, shape, dataset_bytes, linked))
    room.check_free_space(Path(out).resolve().parent, disk.export_bytes(trainer, states, shape, linked),
                          storage["reserve_gib"], storage["check_free_space"], f"the {trainer} export")
    return dataset_bytes


def report_bytes(trainer: str, out: Path, dataset_bytes: int) -> int:
    """Log and return the bytes the export added to the run: its files that have no other name (a hard
    link to the store's or the run's file adds nothing)."""
    added = sum(st.st_blocks * 512 for p in Path(out).rglob("*") if p.is_file() and (st := p.lstat()).st_nlink == 1)
    logger.info("disk: the %s export added %s (%.3fx the packed dataset)", trainer, disk.human_bytes(added),
                added / max(dataset_bytes, 1))
    return added
