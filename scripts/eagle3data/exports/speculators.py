"""Export a packed dataset for speculators 0.9's EAGLE-3 trainer (`speculators train`), streamed.

The layout its `ArrowDataset` reads from `--data-path D`:

- `D/` a `datasets` Arrow dataset saved in torch format with `input_ids`, `loss_mask` (0/1) and `seq_len`;
- `D/hidden_states/hs_{i}.safetensors` for row i: `token_ids [L]` (int64, equal to row i's input_ids: the
  trainer silently drops rows where they differ) and `hidden_states [L, n_aux + 1, H]`: the aux states in
  `--target-layer-ids` order, then the verifier's last hidden state before the final norm;
- `D/token_freq.pt`, and `D/d2t-<n>.npy`, `D/t2d-<n>.npy`: the pipeline's draft vocabulary, which the
  trainer picks up for `--draft-vocab-size <n>` instead of deriving its own.

Rows keep the packed order (the trainer validates on the last 10 %). Memory is one packed row at a time
plus the Arrow writer's batch. `python -m eagle3data.exports.speculators DATASET OUT --token-freq F
--vocab-mapping M [--layer-ids 2 4 5] [--store DIR] [--states reader|files]`.

`--states reader` (the default) writes no `hidden_states/`: the trainer, run with `--hidden-states-backend
eagle3data` (`speculators_reader.py`), reads each row's states from the packed dataset the manifest names,
and the export costs its table (5 bytes a token) and the vocabulary files. `--states files` (config
`export.speculators.states: files`) writes `hidden_states/` for speculators' own `file` backend.

With `--states files`, the store given (the rule gives it) and the trainer's slots the dataset's own (every capture, in
slot order: the default layer ids), a sample's `hs_{i}.safetensors` is a hard link to its file in the
store, which has exactly these two tensors: the export then costs no state bytes on disk. A store file
is linked only when its tensors' names, shapes and dtypes are the ones written here, its token ids are
the row's, and it is older than the packed dataset (store files are replaced, never changed in place, so
it is the file pack read and checked); otherwise the file is written as a copy.

Checksums: a written `hs_{i}.safetensors` states in its safetensors metadata (`eagle3data.crc32`) the
CRC32 of each slot of its `hidden_states` (token by token, as the packed dataset's) and of its
`token_ids`, with the row and sample; a linked store file states its captures' CRCs in the facts the
connector wrote. speculators' own `file` backend reads neither; the `eagle3data` backend
(speculators_reader.py) reads files exports too and verifies every file as it reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from datasets.arrow_writer import ArrowWriter
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from eagle3data.dataset.format import open_dataset
from eagle3data.exports.common import (DEFAULT_STATES, READER_BACKEND, STATES, check_states, export_shape,
                                       link_or_copy, plan_disk, report_bytes, staging_dir, write_manifest)
from eagle3data.utils.logs import get_logger
from eagle3data.storage.store import sample_path
from eagle3data.exports.trainers import SPECULATORS, ExportRefused, layout
from eagle3data.exports.vocab import read_mapping
from eagle3data.plan.disk import FILE_BLOCK_BYTES

logger = get_logger(__name__)
CRC_KEY = "eagle3data.crc32"  # a written hs_{i}.safetensors' metadata: `states_crcs`

FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "seq_len": datasets.Value("int32"),
    }
)


def linkable(stored: Path, row: dict, packed_at: float) -> bool:
    """The store file holds exactly what this export would write for `row` (module docstring)."""
    try:
        if stored.stat().st_mtime > packed_at:
            return False
        with safe_open(str(stored), framework="pt") as f:
            if sorted(f.keys()) != ["hidden_states", "token_ids"]:
                return False
            states = f.get_slice("hidden_states")
            ids = f.get_tensor("token_ids")
    except (OSError, ValueError, RuntimeError):
        return False
    return (list(states.get_shape()) == list(row["hidden_states"].shape) and states.get_dtype() == "BF16"
            and ids.dtype == row["input_ids"].dtype and bool((ids == row["input_ids"]).all()))


def hard_link(stored: Path, target: Path) -> bool:
    """Link `target` to `stored`; False where the filesystem cannot (another device, no links)."""
    try:
        os.link(stored, target)
    except OSError:
        return False
    return True


def states_crcs(states, token_ids) -> dict:
    """The CRC32s an `hs_{i}.safetensors` states (hex): each slot of `hidden_states` `[L, n, H]`, and the
    token ids' bytes."""
    from isal import isal_zlib

    from eagle3data.storage.compression import capture_crcs

    values = states.contiguous().view(torch.uint16 if states.element_size() == 2 else torch.int32).numpy()
    return {"hidden_states": [f"{c:08x}" for c in capture_crcs(values)],
            "token_ids": f"{isal_zlib.crc32(token_ids.contiguous().numpy().view(np.uint8)):08x}"}


def write_states_file(row: dict, slots: list[int], target: Path, stored: Path | None, packed_at: float,
                      index: int = 0) -> bool:
    """Row's `hs_{i}.safetensors`: a hard link to `stored` where it holds exactly this (True), else written
    with its CRC32s in its metadata."""
    if stored is not None and linkable(stored, row, packed_at) and hard_link(stored, target):
        return True
    states = row["hidden_states"][:, slots, :].contiguous()  # a copy: this sample's bytes only
    about = {"row": index, "sample_id": row["sample_id"], **states_crcs(states, row["input_ids"])}
    save_file({"hidden_states": states, "token_ids": row["input_ids"]}, str(target),
              metadata={CRC_KEY: json.dumps(about)})
    return False


def export(dataset_path: str | Path, out: str | Path, token_freq: str | Path, vocab_mapping: str | Path,
           layer_ids: list[int] | None = None, store_dir: str | Path | None = None, states: str = DEFAULT_STATES,
           storage: dict | None = None) -> dict:
    """Write the speculators layout of the packed dataset at `dataset_path` to `out`; return its manifest.
    `states`: "reader" (no states: speculators_reader.py) or "files" (hs_{i}.safetensors, linked or
    written). `storage`: the run's storage settings, for the free-space check (common.plan_disk)."""
    check_states(states)
    ds = open_dataset(Path(dataset_path).resolve())  # the manifest names it for the reader, from anywhere
    lay = layout(SPECULATORS, ds.metadata, layer_ids)
    slots = [*lay.aux_slots, lay.final_slot]
    own_slots = slots == list(range(len(ds.metadata["captures"])))
    packed_at = Path(dataset_path, "eagle3_metadata.json").stat().st_mtime
    linked = 0
    d2t, t2d = read_mapping(vocab_mapping)
    may_link = bool(store_dir) and own_slots and len(ds) > 0 and sample_path(store_dir, ds[0]["sample_id"]).is_file()
    # d2t/t2d as large as the mapping's tensors; the table's two JSON files and the manifest (token_freq: a link)
    small = Path(vocab_mapping).stat().st_size + 5 * FILE_BLOCK_BYTES
    dataset_bytes = plan_disk(ds, SPECULATORS.name, states, export_shape(ds, len(slots), small), out, storage, may_link)
    with staging_dir(out) as tmp:
        if states == "files":
            (tmp / "hidden_states").mkdir()
        columns = tmp / ".columns" / "data.arrow"  # outside tmp itself: save_to_disk refuses its own source
        columns.parent.mkdir()
        with ArrowWriter(features=FEATURES, path=str(columns)) as writer:
            for i, row in enumerate(tqdm(ds, total=len(ds), desc="export speculators", unit="sample")):
                if states == "files":
                    stored = sample_path(store_dir, row["sample_id"]) if store_dir and own_slots else None
                    linked += write_states_file(row, slots, tmp / "hidden_states" / f"hs_{i}.safetensors",
                                                stored, packed_at, i)
                writer.write({"input_ids": row["input_ids"].tolist(), "loss_mask": row["loss_mask"].tolist(),
                              "seq_len": len(row["input_ids"])})
            writer.finalize()
        datasets.Dataset.from_file(str(columns)).with_format("torch").save_to_disk(str(tmp))
        shutil.rmtree(columns.parent)
        link_or_copy(token_freq, tmp / "token_freq.pt")
        np.save(tmp / f"d2t-{d2t.numel()}.npy", d2t.numpy())
        np.save(tmp / f"t2d-{d2t.numel()}.npy", t2d.numpy())
        # The reader's slots of the packed states, in the trainer's order: aux states, then the final one.
        backend = {"hidden_states_backend": READER_BACKEND, "reader_slots": slots} if states == "reader" else {}
        manifest = write_manifest(tmp, ds, lay, d2t.numel(), trainer_version="0.9.0", **backend)
    if states == "reader":
        logger.info("exported %d samples for speculators to %s (--target-layer-ids %s) without states: train "
                    "with --hidden-states-backend %s (python -m eagle3data.exports.speculators_reader)", len(ds), out,
                    " ".join(map(str, lay.layer_ids)), READER_BACKEND)
    else:
        logger.info("exported %d samples for speculators to %s (--target-layer-ids %s); %d of them hard links "
                    "to the store's files, the rest copies", len(ds), out, " ".join(map(str, lay.layer_ids)), linked)
    report_bytes(SPECULATORS.name, Path(out), dataset_bytes)
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", help="packed dataset directory (results/<run>/dataset)")
    parser.add_argument("out", help="export directory to create (speculators' --data-path)")
    parser.add_argument("--token-freq", required=True, help="results/<run>/token_freq.pt")
    parser.add_argument("--vocab-mapping", required=True, help="results/<run>/vocab_mapping.pt")
    parser.add_argument("--layer-ids", type=int, nargs="+", default=None,
                        help="--target-layer-ids the draft will be trained with (vLLM aux ids); default: "
                             "every capture but the final state, in slot order")
    parser.add_argument("--store", help="the run's store (results/<run>/states/<key>): link its files where "
                                            "they hold exactly what would be written")
    parser.add_argument("--states", choices=STATES, default=DEFAULT_STATES,
                        help="reader (default): no states, the trainer reads the packed dataset through "
                             "eagle3data.exports.speculators_reader; files: hidden_states/hs_{i}.safetensors, a "
                             "copy of the states (hard links to the store's files where it holds them)")
    args = parser.parse_args(argv)
    try:
        export(args.dataset, args.out, args.token_freq, args.vocab_mapping, args.layer_ids, args.store, args.states)
    except ExportRefused as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
