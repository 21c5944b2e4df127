"""Token frequencies over trainable tokens, and the draft vocabulary they choose.

An EAGLE-3 draft predicts over a smaller vocabulary than its target: the `draft_vocab_size` tokens seen
most often where the loss is on. Both files come from the data, so the pipeline writes them next to it:

- `token_freq.pt`: `{token_id: count}` over tokens with loss_mask 1 (speculators' format and name);
- `vocab_mapping.pt`: `{"d2t": int64 [draft], "t2d": bool [target vocab]}` (SpecForge's format; the
  speculators export writes the same tensors as its `d2t-<n>.npy` / `t2d-<n>.npy`). The draft tokens are
  the most frequent (ties: lower id first), padded with the lowest unused ids when fewer distinct tokens
  were seen, sorted; `d2t[i]` is the offset from draft id i to its target id, `t2d[t]` says whether
  target token t is in the draft vocabulary.

Counting reads only the ids and masks, one Arrow batch at a time; memory is one batch plus the vocabulary.
`python -m eagle3data.exports.vocab DATASET --model CHECKPOINT --draft-vocab-size N --out-dir DIR`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import torch

from eagle3data.dataset.format import open_dataset
from eagle3data.utils.logs import get_logger
from eagle3data.model.info import read_dataset_model
from eagle3data.storage.store import atomic_path

logger = get_logger(__name__)


class VocabError(ValueError):
    pass


def token_counts(dataset_path: str | Path, vocab_size: int) -> np.ndarray:
    """Counts `[vocab_size]` of each token id over trainable tokens (loss_mask 1), streamed."""
    ds = open_dataset(dataset_path)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in ds.hf.select_columns(["sample_id", "input_ids", "loss_mask"]).iter(batch_size=256):
        ids = pc.list_flatten(batch["input_ids"]).to_numpy().astype(np.int64)
        mask = pc.list_flatten(batch["loss_mask"]).to_numpy()
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            row = pc.list_parent_indices(batch["input_ids"]).to_numpy()[bad[0]]
            raise VocabError(
                f"sample {batch['sample_id'][row]} | check 0 <= input_ids < vocab_size | expected ids in "
                f"[0, {vocab_size}) | found {ids[bad[0]]} | file {dataset_path}"
            )
        counts += np.bincount(ids[mask == 1], minlength=vocab_size)
    return counts


def draft_mapping(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` (<= counts.size) most frequent tokens of `counts`."""
    seen = np.flatnonzero(counts)
    ranked = seen[np.lexsort((seen, -counts[seen]))][:draft_vocab_size]
    if ranked.size < draft_vocab_size:
        unused = np.setdiff1d(np.arange(counts.size), ranked)[: draft_vocab_size - ranked.size]
        ranked = np.concatenate([ranked, unused])
    chosen = torch.from_numpy(np.sort(ranked).astype(np.int64))
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(counts.size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def read_mapping(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a vocab_mapping.pt, refused unless t2d selects exactly the ids d2t maps to."""
    mapping = torch.load(path, weights_only=True)
    d2t, t2d = mapping["d2t"], mapping["t2d"]
    chosen = torch.nonzero(t2d).flatten()
    expected = d2t + torch.arange(d2t.numel())
    if t2d.dtype != torch.bool or chosen.numel() != d2t.numel() or not torch.equal(chosen, expected):
        raise VocabError(
            f"{path}: expected t2d (bool) to select exactly the target ids d2t + arange(len(d2t)) "
            f"({d2t.numel()} ids), found {chosen.numel()} selected ({t2d.dtype})"
        )
    return d2t, t2d


def write_vocab(dataset_path: str | Path, model_path: str | Path, draft_vocab_size: int,
                token_freq_out: str | Path, mapping_out: str | Path) -> dict:
    """Write token_freq.pt and vocab_mapping.pt for the dataset; return a short summary."""
    info = read_dataset_model(model_path, open_dataset(dataset_path).metadata)
    if not 0 < draft_vocab_size <= info.vocab_size:
        raise VocabError(
            f"draft_vocab_size: expected 1..{info.vocab_size} (the vocabulary of {model_path}), found "
            f"{draft_vocab_size}"
        )
    counts = token_counts(dataset_path, info.vocab_size)
    d2t, t2d = draft_mapping(counts, draft_vocab_size)
    with atomic_path(token_freq_out) as tmp:
        torch.save({int(t): int(counts[t]) for t in np.flatnonzero(counts)}, tmp)
    with atomic_path(mapping_out) as tmp:
        torch.save({"d2t": d2t, "t2d": t2d}, tmp)
    total = int(counts.sum())
    covered = int(counts[t2d.numpy()].sum())
    summary = {"trainable_tokens": total, "distinct_tokens": int(np.count_nonzero(counts)),
               "draft_vocab_size": draft_vocab_size, "target_vocab_size": info.vocab_size,
               "coverage": covered / total if total else 0.0}
    logger.info("draft vocabulary: %s", summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", help="packed dataset directory (results/<run>/dataset)")
    parser.add_argument("--model", required=True, help="the target checkpoint the dataset was extracted from")
    parser.add_argument("--draft-vocab-size", type=int, required=True)
    parser.add_argument("--out-dir", required=True, help="writes token_freq.pt and vocab_mapping.pt here")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    write_vocab(args.dataset, args.model, args.draft_vocab_size, out / "token_freq.pt",
                out / "vocab_mapping.pt")


if __name__ == "__main__":
    main()
