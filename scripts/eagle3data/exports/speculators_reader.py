"""speculators 0.9 reads the packed dataset's states where they are: a hidden-states backend, `eagle3data`.

speculators' trainer takes row i's states from the `HiddenStatesTransfer` of the backend that
`--hidden-states-backend` names (hs_connectors' registry; its `file` backend reads
`<data-path>/hidden_states/hs_{i}.safetensors`). This module registers one more, `eagle3data`, that reads
row i of the packed dataset an export was made from (named in its `eagle3_export.json`), in the
trainer's slot order. An export written with `--states reader` (config
`export.speculators.states: reader`) therefore holds no state bytes: speculators' table, token_freq,
vocabulary files and the manifest, a few MB for any size of dataset. The reader refuses a dataset that
is not the one exported (its fingerprint or sample count changed); the trainer compares each row's token
ids with its input ids as it does for files.

The backend reads files exports too (`--states files`): row i is `hidden_states/hs_{i}.safetensors`, as
speculators' `file` backend reads it, but verified against the CRC32s the file states (speculators.py).
Every read is verified unless EAGLE3DATA_VERIFY=0: a reader export's rows as `open_dataset` verifies them,
a files export's files against their own CRC32s, and either's small files against the manifest's
(`files_crc32`), once a process. A changed byte is an `IntegrityError` naming the row and capture.

speculators has no plugin entry point, so the backend must be registered before its CLI resolves the
arguments: `python -m eagle3data.exports.speculators_reader <speculators train flags> --hidden-states-backend
eagle3data` does that and runs the trainer (`eagle3bench.speculators_cpu` imports it too).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer
from safetensors import safe_open

from eagle3data.dataset.format import IntegrityError, PackedDataset, is_compressed, verifying
from eagle3data.exports.common import (READER_BACKEND, ReaderMismatch, open_exported_dataset, read_manifest,
                                       read_reader_manifest, verify_export_files)
from eagle3data.exports.speculators import CRC_KEY, states_crcs

FACTS_KEY = "eagle3data.capture_facts"  # contracts.states.FACTS_KEY, not imported here: it brings pandera


class PackedStatesTransfer(HiddenStatesTransfer):
    """Row i's `hidden_states [L, n_aux + 1, H]` and `token_ids [L]`, read from the packed dataset."""

    def __init__(self, export_dir: str | Path):
        self.export_dir = Path(export_dir)
        self.manifest = read_reader_manifest(self.export_dir)
        self.slots = self.manifest["reader_slots"]
        self._dataset: PackedDataset | None = None  # opened on first use: in each dataloader worker

    @property
    def dataset(self) -> PackedDataset:
        if self._dataset is None:
            verify_export_files(self.export_dir, self.manifest)
            self._dataset = open_exported_dataset(self.export_dir, self.manifest)
        return self._dataset

    def __getstate__(self) -> dict:  # a dataloader worker opens its own memory map
        return {**self.__dict__, "_dataset": None}

    @functools.cached_property
    def rows_as_decoded(self) -> bool:
        """Whether a row's states go to the trainer as they are read: decompressed into new memory, their
        slots already the trainer's order. Otherwise the slots are copied out (of the read-only memory map,
        or reordered): on 2 cores that copy took a quarter of the reader's time."""
        return is_compressed(self.dataset.metadata) and self.slots == list(range(self.dataset.n_captures))

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        row = self.dataset[file_idx]
        states = row["hidden_states"] if self.rows_as_decoded else row["hidden_states"][:, self.slots, :]
        return {"hidden_states": states, "token_ids": row["input_ids"]}

    def get_generated(self, hs_transfer_params: dict) -> None:
        raise ReaderMismatch("the eagle3data backend reads packed states only: run with --on-missing raise")


class CheckedFileTransfer(HiddenStatesTransfer):
    """Row i of a files export, `hidden_states/hs_{i}.safetensors`, verified against the CRC32s it states."""

    def __init__(self, export_dir: str | Path):
        self.export_dir = Path(export_dir)
        self.manifest = read_manifest(self.export_dir)
        self._checked = False  # the manifest's small files: verified on first use, in each dataloader worker

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        if not self._checked:
            verify_export_files(self.export_dir, self.manifest)
            self._checked = True
        path = self.export_dir / "hidden_states" / f"hs_{file_idx}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            metadata = f.metadata() or {}
        if verifying():
            verify_states_file(path, file_idx, tensors, metadata)
        return tensors

    def get_generated(self, hs_transfer_params: dict) -> None:
        raise ReaderMismatch("the eagle3data backend reads exported states only: run with --on-missing raise")


def verify_states_file(path: Path, row: int, tensors: dict, metadata: dict) -> None:
    """An `hs_{i}.safetensors` against the CRC32s its metadata states (written: `eagle3data.crc32`; linked
    from the store: the facts the connector wrote, its captures only)."""
    if CRC_KEY in metadata:
        stated = json.loads(metadata[CRC_KEY])
    elif FACTS_KEY in metadata:
        stated = {"hidden_states": [slot["checksum"] for slot in json.loads(metadata[FACTS_KEY])]}
    else:
        raise IntegrityError(f"{path}: no checksums in its metadata (written before exports carried them): "
                             "export again, or set EAGLE3DATA_VERIFY=0 to read it unverified")
    found = states_crcs(tensors["hidden_states"], tensors["token_ids"])
    bad = [f"capture {slot} (CRC32 {b}, stated {a})" for slot, (a, b) in
           enumerate(zip(stated["hidden_states"], found["hidden_states"])) if a != b]
    if "token_ids" in stated and stated["token_ids"] != found["token_ids"]:
        bad.append(f"token_ids (CRC32 {found['token_ids']}, stated {stated['token_ids']})")
    if bad:
        raise IntegrityError(f"{path}: row {row} (sample {stated.get('sample_id', 'unknown')}) is not what the "
                             f"export wrote: {'; '.join(bad)}. Copy the export again from its source, or export again.")


@HiddenStatesBackend.register(READER_BACKEND)
class PackedStatesBackend(HiddenStatesBackend):
    """speculators' side: the transfer for `--data-path`, an export written with `--states reader` or
    `--states files`."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        pass

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        pass

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> HiddenStatesTransfer:
        return transfer(data_path)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict:
        raise ReaderMismatch("the eagle3data backend serves training only; it generates nothing")


def transfer(export_dir: str | Path) -> HiddenStatesTransfer:
    """The transfer for an export: its packed rows (a reader export) or its files, verified either way."""
    if read_manifest(Path(export_dir)).get("hidden_states_backend") == READER_BACKEND:
        return PackedStatesTransfer(export_dir)
    return CheckedFileTransfer(export_dir)


def main() -> None:
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    cli.main(TrainConfig.resolve())


if __name__ == "__main__":
    main()
