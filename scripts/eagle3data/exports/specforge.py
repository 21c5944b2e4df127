"""Export a packed dataset for SpecForge's offline EAGLE-3 training (`data.hidden_states_path`), streamed.

SpecForge's offline reader lists every `*.ckpt` under the path (sorted) and `torch.load`s each, as its
`scripts/prepare_hidden_states.py` writes them: a dict with `input_ids [L]` and `loss_mask [L]` (int64),
`aux_hidden_state [1, L, 3H]` (the three aux states concatenated in `aux_hidden_state_layer_ids` order)
and `hidden_state [1, L, H]`, the target's last hidden state AFTER the final norm. The dataset stores that
state before the norm, so it is computed here with the checkpoint's own final norm (`final_norm.py`).
SpecForge numbers aux layers by output (id k = output of decoder layer k): the ids are the dataset's vLLM
aux ids minus one; ids the dataset did not capture are refused (`trainers.py`).

Out: `OUT/hidden_states/data_<i:08d>.ckpt` (packed order), `OUT/vocab_mapping.pt` (the pipeline's draft
vocabulary, for `model.vocab_mapping_path`) and `OUT/eagle3_export.json`. Memory is one sample at a time.
`python -m eagle3data.exports.specforge DATASET OUT --model CHECKPOINT --vocab-mapping M [--layer-ids 1 3 4]
[--states reader|files]`.

`--states reader` (the default) writes in each `data_<i>.ckpt` only a pointer to row i (`{"eagle3data_row":
i}`, under 1 KB, a filesystem block on disk) and the final norm's weight once (`final_norm.pt`): trained
through `python -m eagle3data.exports.specforge_reader`, SpecForge gets from each pointer the tensors above,
computed from the packed dataset by the same function (`features`) as a files export writes them.
`--states files` (config `export.specforge.states: files`) writes the tensors themselves, for SpecForge's
own loader: a decompressed copy of the states.

Checksums: a files export's feature file holds, beside SpecForge's keys, `eagle3data_crc32` (its tensors'
CRC32s, `aux_hidden_state` per capture; SpecForge reads only its own keys); a pointer names its row's
sample id too. The reader checks both (specforge_reader.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from eagle3data.dataset.format import open_dataset
from eagle3data.exports.common import (DEFAULT_STATES, READER_BACKEND, STATES, check_states, export_shape,
                                       link_or_copy, plan_disk, report_bytes, staging_dir, write_manifest)
from eagle3data.exports.final_norm import read_final_norm
from eagle3data.model.weights import FinalNorm
from eagle3data.utils.logs import get_logger
from eagle3data.exports.trainers import SPECFORGE, ExportRefused, layout
from eagle3data.exports.vocab import read_mapping
from eagle3data.plan.disk import FILE_BLOCK_BYTES

logger = get_logger(__name__)


POINTER_KEY = "eagle3data_row"  # a reader export's feature file: which packed row it stands for
SAMPLE_KEY = "eagle3data_sample_id"  # ... and that row's sample id (the reader checks it)
CRC_KEY = "eagle3data_crc32"  # a files export's feature file: its tensors' CRC32s (`feature_crcs`)
FINAL_NORM_FILE = "final_norm.pt"


def tensor_bytes(t: torch.Tensor):
    """A tensor's bytes as numpy uint8, not copied where it is contiguous."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def feature_crcs(content: dict, row: int, sample_id: str) -> dict:
    """The CRC32s of a feature file's tensors, as ints: `aux_hidden_state` per capture (its `[L, n_aux, H]`
    values, token by token, as the packed dataset's CRCs are taken), the others whole; with the packed row
    and sample they come from."""
    from isal import isal_zlib

    from eagle3data.storage.compression import capture_crcs

    aux = content["aux_hidden_state"]
    hidden = content["hidden_state"].shape[-1]
    values = tensor_bytes(aux).view(np.uint16 if aux.element_size() == 2 else np.uint32)
    return {"row": row, "sample_id": sample_id,
            "aux_hidden_state": capture_crcs(values.reshape(aux.shape[1], -1, hidden)),
            **{k: isal_zlib.crc32(tensor_bytes(content[k])) for k in ("hidden_state", "input_ids", "loss_mask")}}


def verify_features(path: str, content: dict) -> None:
    """A files export's feature file against the CRC32s it states (IntegrityError naming the row, the
    sample and each tensor or capture that fails)."""
    from eagle3data.dataset.format import IntegrityError

    stated = content[CRC_KEY]
    found = feature_crcs(content, stated["row"], stated["sample_id"])
    bad = [f"aux_hidden_state capture {c}" for c, (a, b) in
           enumerate(zip(stated["aux_hidden_state"], found["aux_hidden_state"])) if a != b]
    bad += [k for k in ("hidden_state", "input_ids", "loss_mask") if stated[k] != found[k]]
    if bad:
        raise IntegrityError(f"{path}: row {stated['row']} (sample {stated['sample_id']}) is not what the export wrote: "
                             f"CRC32 of {', '.join(bad)} differ. Copy the export again from its source, or export again.")


def features(row: dict, aux_slots: list[int], final_slot: int, norm: FinalNorm) -> dict:
    """SpecForge's feature file for one packed row."""
    states = row["hidden_states"]
    length = states.shape[0]
    return {
        "input_ids": row["input_ids"],
        "loss_mask": row["loss_mask"],
        "aux_hidden_state": states[:, aux_slots, :].reshape(1, length, -1),
        "hidden_state": norm(states[:, final_slot, :]).unsqueeze(0),
    }


def export(dataset_path: str | Path, out: str | Path, model_path: str | Path, vocab_mapping: str | Path,
           layer_ids: list[int] | None = None, states: str = DEFAULT_STATES, storage: dict | None = None) -> dict:
    """Write the SpecForge layout of the packed dataset at `dataset_path` to `out`; return its manifest.
    `states`: "reader" (pointers: specforge_reader.py) or "files" (the tensors in each feature file).
    `storage`: the run's storage settings, for the free-space check (common.plan_disk)."""
    check_states(states)
    ds = open_dataset(Path(dataset_path).resolve())  # the manifest names it for the reader, from anywhere
    lay = layout(SPECFORGE, ds.metadata, layer_ids)
    norm = read_final_norm(model_path, ds.metadata)
    d2t, _ = read_mapping(vocab_mapping)
    small = norm.weight.numel() * 4 + 2 * FILE_BLOCK_BYTES  # final_norm.pt and the manifest (the mapping: a link)
    dataset_bytes = plan_disk(ds, SPECFORGE.name, states, export_shape(ds, len(lay.aux_slots) + 1, small), out, storage)
    with staging_dir(out) as tmp:
        (tmp / "hidden_states").mkdir()
        for i, row in enumerate(tqdm(ds, total=len(ds), desc="export specforge", unit="sample")):
            if states == "reader":
                content = {POINTER_KEY: i, SAMPLE_KEY: row["sample_id"]}
            else:
                content = features(row, lay.aux_slots, lay.final_slot, norm)
                content[CRC_KEY] = feature_crcs(content, i, row["sample_id"])
            torch.save(content, tmp / "hidden_states" / f"data_{i:08d}.ckpt")
        link_or_copy(vocab_mapping, tmp / "vocab_mapping.pt")
        backend = {}
        if states == "reader":
            torch.save({"weight": norm.weight, "eps": norm.eps, "source": norm.source}, tmp / FINAL_NORM_FILE)
            backend = {"hidden_states_backend": READER_BACKEND, "reader_final_slot": lay.final_slot}
        manifest = write_manifest(tmp, ds, lay, d2t.numel(), trainer_version="0.2.0",
                                  final_norm={"source": norm.source, "rms_norm_eps": norm.eps,
                                              "computed_in": "float32, rounded once to the dataset dtype"},
                                  **backend)
    logger.info("exported %d samples for SpecForge to %s (aux_hidden_state_layer_ids %s)%s", len(ds), out,
                lay.layer_ids, " as pointers to the packed rows: train through python -m "
                "eagle3data.exports.specforge_reader" if states == "reader" else "")
    report_bytes(SPECFORGE.name, Path(out), dataset_bytes)
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", help="packed dataset directory (results/<run>/dataset)")
    parser.add_argument("out", help="export directory to create")
    parser.add_argument("--model", required=True, help="the target checkpoint the dataset was extracted from")
    parser.add_argument("--vocab-mapping", required=True, help="results/<run>/vocab_mapping.pt")
    parser.add_argument("--layer-ids", type=int, nargs="+", default=None,
                        help="aux_hidden_state_layer_ids the draft will be trained with (SpecForge ids: output "
                             "of layer k); default: every capture but the final state, in slot order")
    parser.add_argument("--states", choices=STATES, default=DEFAULT_STATES,
                        help="reader (default): pointers to the packed rows, read through python -m "
                             "eagle3data.exports.specforge_reader; files: the tensors in each feature file, a "
                             "copy of the states")
    args = parser.parse_args(argv)
    try:
        export(args.dataset, args.out, args.model, args.vocab_mapping, args.layer_ids, args.states)
    except ExportRefused as exc:
        sys.exit(str(exc))


if __name__ == "__main__":
    main()
