"""Single tensors of a checkpoint and the size of its layers, read by name from the safetensors files
without loading the model: what the parity gate needs of a model as large as Kimi-K2.5 (its final norm
and output head, and how much memory its first decoder layers take).

Names are looked for as plain causal LMs and multimodal wrappers (Kimi-K2.5) store them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # torch is imported where a tensor is read: planning reads headers only
    import torch

_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
NORM_NAMES = tuple(f"{prefix}norm.weight" for prefix in _PREFIXES)
EMBEDDING_NAMES = tuple(f"{prefix}embed_tokens.weight" for prefix in _PREFIXES)
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
# Text model types whose final norm is a plain RMSNorm.
RMSNORM_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
     "kimi_k2"}
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_OUTSIDE_TEXT = ("vision", "mm_projector", "multi_modal", "visual")


class MissingTensor(LookupError):
    pass


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> its file, from the index of a sharded checkpoint or else
    from each file's header."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {name: model_dir / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    found = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            found.update(dict.fromkeys(f.keys(), path))
    return found


def read_tensor(model_dir: str | Path, names: tuple[str, ...], files: dict[str, Path] | None = None
                ) -> tuple[str, torch.Tensor]:
    """(name, tensor) of the first of `names` the checkpoint holds, in its stored dtype."""
    files = tensor_files(model_dir) if files is None else files
    for name in names:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as f:
                return name, f.get_tensor(name)
    raise MissingTensor(f"{model_dir}: expected one of {list(names)} in the safetensors weights, found none")


def output_head(model_dir: str | Path, files: dict[str, Path] | None = None) -> tuple[str, torch.Tensor]:
    """The output head's weight [vocab, H]: the input embeddings' where the checkpoint ties them (holds no
    head of its own)."""
    files = tensor_files(model_dir) if files is None else files
    found = any(name in files for name in HEAD_NAMES)
    return read_tensor(model_dir, HEAD_NAMES if found else EMBEDDING_NAMES, files)


@dataclass(frozen=True)
class FinalNorm:
    """A plain RMSNorm, y = w * x / sqrt(mean(x^2) + eps), computed in float32 in transformers' order of
    operations (its RMSNorm run in float32 gives the same bits)."""

    weight: torch.Tensor  # [H] float32
    eps: float
    source: str  # file and tensor name, for messages and metadata

    def __call__(self, pre_norm: torch.Tensor) -> torch.Tensor:
        """The post-norm state of `pre_norm [..., H]`, in `pre_norm`'s dtype."""
        x = pre_norm.float()
        variance = x.pow(2).mean(-1, keepdim=True)
        return (self.weight * (x * (variance + self.eps).rsqrt())).to(pre_norm.dtype)


class NotRMSNorm(ValueError):
    pass


def read_final_norm(model_dir: str | Path, files: dict[str, Path] | None = None) -> FinalNorm:
    """The checkpoint's final norm (one tensor read by name). Families whose final norm is something else
    (Gemma's 1 + w, LayerNorm) raise NotRMSNorm: refused, not approximated."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    model_type = text.get("model_type", raw.get("model_type"))
    if model_type not in RMSNORM_MODEL_TYPES:
        raise NotRMSNorm(f"model_type {model_type!r} at {model_dir} is not known to end in a plain RMSNorm "
                         f"(known: {sorted(RMSNORM_MODEL_TYPES)})")
    if text.get("rms_norm_eps") is None:
        raise NotRMSNorm(f"expected rms_norm_eps in {model_dir / 'config.json'}, found none")
    files = tensor_files(model_dir) if files is None else files
    name, weight = read_tensor(model_dir, NORM_NAMES, files)
    return FinalNorm(weight.float(), float(text["rms_norm_eps"]), f"{files[name].name}:{name}")


def float32_bytes(model_dir: str | Path, layers: int, files: dict[str, Path] | None = None) -> int:
    """Bytes in float32 of the text model's weights outside its decoder layers plus those of its first
    `layers` decoder layers: what transformers holds of a model cut after that many layers. Only the
    files' headers are read."""
    files = tensor_files(model_dir) if files is None else files
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if not any(part in name for part in _OUTSIDE_TEXT):
            match = _LAYER.search(name)
            if match is None or int(match.group(1)) < layers:
                by_file.setdefault(path, []).append(name)
    count = 0
    for path, names in by_file.items():
        with safe_open(str(path), framework="numpy") as f:
            for name in names:
                count += _numel(f.get_slice(name).get_shape())
    return 4 * count


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def reference_layers(model_dir: str | Path, streams: list[int], budget_bytes: float,
                     files: dict[str, Path] | None = None) -> tuple[int, int, int]:
    """(the deepest of `streams` whose first layers fit `budget_bytes` in float32, or 0; the bytes they
    take; the bytes the shallowest stream would take): how far a float32 reference can follow."""
    files = tensor_files(model_dir) if files is None else files
    needs = {s: float32_bytes(model_dir, s, files) for s in sorted(set(streams))}
    fitting = [s for s, need in needs.items() if need <= budget_bytes]
    deepest = fitting[-1] if fitting else 0
    return deepest, needs.get(deepest, 0), next(iter(needs.values()))
