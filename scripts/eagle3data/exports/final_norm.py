"""The target's final norm, read from its checkpoint, to turn the stored pre-norm final state post-norm.

SpecForge trains on the verifier's last hidden state AFTER the final norm; the dataset stores it before
(what vLLM and speculators use). The final norm of the supported families is an RMSNorm,
y = w * x / sqrt(mean(x^2) + eps), so the post-norm state follows exactly from the stored one, the
checkpoint's final norm weight and its config's `rms_norm_eps`: computed in float32 in transformers' order
of operations (its RMSNorm run in float32 gives the same bits) and rounded once to the dataset dtype.
Only that one tensor is read from the weights (safetensors, by name), whatever the checkpoint's size.
Families whose final norm is something else (Gemma's 1 + w, LayerNorm) are refused, not approximated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3data.model.info import read_dataset_model
from eagle3data.exports.trainers import ExportRefused

# Text model types whose final norm is a plain RMSNorm (weight * x * rsqrt(mean(x^2) + eps)).
RMSNORM_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
     "kimi_k2"}
)
# Where checkpoints keep the final norm: plain causal LMs, then multimodal wrappers (Kimi-K2.5).
WEIGHT_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


@dataclass(frozen=True)
class FinalNorm:
    weight: torch.Tensor  # [H] float32
    eps: float
    source: str  # file and tensor name, for messages and the export's metadata

    def __call__(self, pre_norm: torch.Tensor) -> torch.Tensor:
        """The post-norm state of `pre_norm [..., H]`, in `pre_norm`'s dtype."""
        x = pre_norm.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        return (self.weight * (x * torch.rsqrt(variance + self.eps))).to(pre_norm.dtype)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the sharded checkpoint's index or from each file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / weight_map[name] for name in WEIGHT_NAMES if name in weight_map}
    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found.update({name: path for name in WEIGHT_NAMES if name in f.keys()})
    return found


def read_final_norm(model_path: str | Path, metadata: dict) -> FinalNorm:
    """The final norm of the checkpoint the dataset was extracted from; refuses any other checkpoint."""
    model_dir = Path(model_path)
    info = read_dataset_model(model_dir, metadata)
    if info.model_type not in RMSNORM_MODEL_TYPES:
        raise ExportRefused(
            f"final norm: model_type {info.model_type!r} at {model_dir} is not known to end in a plain "
            f"RMSNorm (known: {sorted(RMSNORM_MODEL_TYPES)}); the post-norm state cannot be computed exactly"
        )
    raw = json.loads((model_dir / "config.json").read_text())
    eps = raw.get("text_config", raw).get("rms_norm_eps")
    if eps is None:
        raise ExportRefused(f"final norm: expected rms_norm_eps in {model_dir / 'config.json'}, found none")
    files = _weight_files(model_dir)
    if not files:
        raise ExportRefused(
            f"final norm: expected one of {list(WEIGHT_NAMES)} in the safetensors weights of {model_dir}, "
            "found none"
        )
    name, path = next(iter(files.items()))
    with safe_open(str(path), framework="pt") as f:
        weight = f.get_tensor(name).float()
    if tuple(weight.shape) != (metadata["hidden_size"],):
        raise ExportRefused(
            f"final norm: {path}:{name} expected shape [{metadata['hidden_size']}], found {list(weight.shape)}"
        )
    return FinalNorm(weight, float(eps), f"{path.name}:{name}")
