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

speculators has no plugin entry point, so the backend must be registered before its CLI resolves the
arguments: `python -m eagle3data.exports.speculators_reader <speculators train flags> --hidden-states-backend
eagle3data` does that and runs the trainer (`eagle3data.bench.speculators_cpu` imports it too).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer

from eagle3data.dataset.format import PackedDataset, is_compressed
from eagle3data.exports.common import READER_BACKEND, ReaderMismatch, open_exported_dataset, read_reader_manifest


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
            self._dataset = open_exported_dataset(self.export_dir, self.manifest)
        return self._dataset

    def __getstate__(self) -> dict:  # a dataloader worker opens its own memory map
        return {**self.__dict__, "_dataset": None}

    @functools.cached_property
    def rows_as_decoded(self) -> bool:
        """Whether a row's states go to the trainer as they are read: decompressed into new memory, their
        slots already the trainer's order. Otherwise the slots are copied out (of the read-only memory map,
        or reordered): on 2 cores that copy took a quarter of the reader's time (figure 12)."""
        return is_compressed(self.dataset.metadata) and self.slots == list(range(self.dataset.n_captures))

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        row = self.dataset[file_idx]
        states = row["hidden_states"] if self.rows_as_decoded else row["hidden_states"][:, self.slots, :]
        return {"hidden_states": states, "token_ids": row["input_ids"]}

    def get_generated(self, hs_transfer_params: dict) -> None:
        raise ReaderMismatch("the eagle3data backend reads packed states only: run with --on-missing raise")


@HiddenStatesBackend.register(READER_BACKEND)
class PackedStatesBackend(HiddenStatesBackend):
    """speculators' side: the transfer for `--data-path`, an export written with `--states reader`."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        pass

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        pass

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> PackedStatesTransfer:
        return PackedStatesTransfer(data_path)

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict:
        raise ReaderMismatch("the eagle3data backend serves training only; it generates nothing")


def main() -> None:
    from speculators.train import cli
    from speculators.train.config import TrainConfig

    cli.main(TrainConfig.resolve())


if __name__ == "__main__":
    main()
