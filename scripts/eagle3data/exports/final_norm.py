"""The target's final norm, read from its checkpoint, to turn the stored pre-norm final state post-norm.

SpecForge trains on the verifier's last hidden state AFTER the final norm; the dataset stores it before
(what vLLM and speculators use). The final norm of the supported families is an RMSNorm
(model/weights.py), so the post-norm state follows exactly from the stored one, the checkpoint's final
norm weight and its config's `rms_norm_eps`, rounded once to the dataset dtype. Only that one tensor is
read from the weights, whatever the checkpoint's size; other families are refused, not approximated.
"""

from __future__ import annotations

from pathlib import Path

from eagle3data.exports.trainers import ExportRefused
from eagle3data.model import weights
from eagle3data.model.info import read_dataset_model


def read_final_norm(model_path: str | Path, metadata: dict) -> weights.FinalNorm:
    """The final norm of the checkpoint the dataset was extracted from; refuses any other checkpoint."""
    model_dir = Path(model_path)
    read_dataset_model(model_dir, metadata)
    try:
        norm = weights.read_final_norm(model_dir)
    except (weights.NotRMSNorm, weights.MissingTensor) as exc:
        raise ExportRefused(f"final norm: {exc}; the post-norm state cannot be computed exactly") from exc
    if tuple(norm.weight.shape) != (metadata["hidden_size"],):
        raise ExportRefused(f"final norm: {norm.source} expected shape [{metadata['hidden_size']}], found "
                            f"{list(norm.weight.shape)}")
    return norm
