"""SpecForge 0.2 reads the packed dataset's states where they are: feature files that point at rows.

SpecForge's offline training lists the `*.ckpt` under `data.hidden_states_path` and loads each with
`specforge.runtime.data_plane.feature_store.load_feature_file`: its feature store does (the trainer's
loader), and so does the token count behind its draft vocabulary. An export written with `--states
reader` (config `export.specforge.states: reader`, exports/specforge.py) holds in each file only a pointer
to row i of the packed dataset its manifest names. This module wraps that loader: a pointer comes back
as the tensors a files export holds for row i, computed from the packed row by the same function
(`export_specforge.features`), with the final norm the export saved; any other file loads as before. The
reader refuses a dataset that is not the one exported (fingerprint or sample count changed).

Every file it loads is verified unless EAGLE3DATA_VERIFY=0: a files export's feature file against the
CRC32s it holds (`eagle3data_crc32`), a pointer's row as `open_dataset` verifies rows and against the
sample id the pointer names, and once per export the small files its manifest lists (`files_crc32`). A
changed byte is an `IntegrityError` naming the file, the row and the tensor or capture.

SpecForge has no plugin registry, so the wrapper is installed into its modules before they load a file:
`python -m eagle3data.exports.specforge_reader train --config run.yaml` does that and runs SpecForge's CLI. It
covers offline training (the feature store and the offline reader), not SpecForge's online or
disaggregated modes. Written against specforge 0.2.0 (pinned in envs/setup.sh).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch

from eagle3data.dataset.format import IntegrityError, verifying
from eagle3data.exports.specforge import CRC_KEY, FINAL_NORM_FILE, POINTER_KEY, SAMPLE_KEY, features, verify_features
from eagle3data.exports.common import (MANIFEST_FILE, open_exported_dataset, read_manifest, read_reader_manifest,
                                       verify_export_files)
from eagle3data.model.weights import FinalNorm


class PackedFeatures:
    """Row i's SpecForge features, from the packed dataset a reader export was made from."""

    def __init__(self, export_dir: Path):
        self.manifest = read_reader_manifest(export_dir)
        verify_export_files(export_dir, self.manifest)
        self.norm = FinalNorm(**torch.load(export_dir / FINAL_NORM_FILE, weights_only=True))
        self.dataset = open_exported_dataset(export_dir, self.manifest)

    def __call__(self, row: int, sample_id: str | None = None) -> dict:
        packed = self.dataset[row]
        if sample_id is not None and packed["sample_id"] != sample_id and verifying():
            raise IntegrityError(f"a pointer to row {row} of {self.dataset.path} names sample {sample_id}, the row holds "
                                 f"{packed['sample_id']}: the pointer file changed; copy the export again")
        return features(packed, self.manifest["aux_slots"], self.manifest["reader_final_slot"], self.norm)


_readers: dict[Path, PackedFeatures] = {}
_checked: set[Path] = set()  # files exports whose manifest and small files were verified
_opening = threading.Lock()  # the loader's prefetch threads ask at once


def resolve(path: str, loaded: dict) -> dict:
    """`loaded` as read from `path`, verified; a pointer becomes its packed row's features."""
    export_dir = Path(path).resolve().parent.parent  # <export>/hidden_states/data_<i>.ckpt
    if POINTER_KEY not in loaded:
        if CRC_KEY in loaded and verifying():
            with _opening:
                if export_dir not in _checked and (export_dir / MANIFEST_FILE).is_file():
                    verify_export_files(export_dir, read_manifest(export_dir))
                _checked.add(export_dir)
            verify_features(path, loaded)
        return loaded
    with _opening:
        if export_dir not in _readers:
            _readers[export_dir] = PackedFeatures(export_dir)
    return _readers[export_dir](int(loaded[POINTER_KEY]), loaded.get(SAMPLE_KEY))


def install() -> None:
    """Wrap SpecForge's feature-file loader where its offline path looks it up."""
    from specforge.runtime.data_plane import feature_store, offline_reader

    original = feature_store.load_feature_file
    if getattr(original, "reads_packed_rows", False):
        return

    def load_feature_file(path: str) -> dict:
        return resolve(path, original(path))

    load_feature_file.reads_packed_rows = True
    for module in (feature_store, offline_reader):
        module.load_feature_file = load_feature_file


def main() -> None:
    install()
    from specforge.cli import main as specforge_main

    sys.exit(specforge_main())


if __name__ == "__main__":
    main()
