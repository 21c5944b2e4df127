"""SpecForge 0.2 reads the packed dataset's states where they are: feature files that point at rows.

SpecForge's offline training lists the `*.ckpt` under `data.hidden_states_path` and loads each with
`specforge.runtime.data_plane.feature_store.load_feature_file`: its feature store does (the trainer's
loader), and so does the token count behind its draft vocabulary. An export written with `--states
reader` (config `export.specforge.states: reader`, exports/specforge.py) holds in each file only a pointer
to row i of the packed dataset its manifest names. This module wraps that loader: a pointer comes back
as the tensors a files export holds for row i, computed from the packed row by the same function
(`export_specforge.features`), with the final norm the export saved; any other file loads as before. The
reader refuses a dataset that is not the one exported (fingerprint or sample count changed).

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

from eagle3data.exports.specforge import FINAL_NORM_FILE, POINTER_KEY, features
from eagle3data.exports.common import open_exported_dataset, read_reader_manifest
from eagle3data.exports.final_norm import FinalNorm


class PackedFeatures:
    """Row i's SpecForge features, from the packed dataset a reader export was made from."""

    def __init__(self, export_dir: Path):
        self.manifest = read_reader_manifest(export_dir)
        self.norm = FinalNorm(**torch.load(export_dir / FINAL_NORM_FILE, weights_only=True))
        self.dataset = open_exported_dataset(export_dir, self.manifest)

    def __call__(self, row: int) -> dict:
        return features(self.dataset[row], self.manifest["aux_slots"], self.manifest["reader_final_slot"],
                        self.norm)


_readers: dict[Path, PackedFeatures] = {}
_opening = threading.Lock()  # the loader's prefetch threads ask at once


def resolve(path: str, loaded: dict) -> dict:
    """`loaded` as read from `path`; a pointer becomes its packed row's features."""
    if POINTER_KEY not in loaded:
        return loaded
    export_dir = Path(path).resolve().parent.parent  # <export>/hidden_states/data_<i>.ckpt
    with _opening:
        if export_dir not in _readers:
            _readers[export_dir] = PackedFeatures(export_dir)
    return _readers[export_dir](int(loaded[POINTER_KEY]))


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
