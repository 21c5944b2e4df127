"""Single tensors of a checkpoint and the size of its layers, read by name from the safetensors files
without loading the model: what the parity gate needs of a model as large as Kimi-K2.5 (its final norm
and output head, and how much memory its first decoder layers take).

Names are looked for as plain causal LMs and multimodal wrappers (Kimi-K2.5) store them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

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
        with safe_open(str(path), framework="pt") as f:
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


def final_norm_eps(model_dir: str | Path) -> float | None:
    """The final norm's epsilon where the model ends in a plain RMSNorm, y = w * x / sqrt(mean(x^2) + eps);
    None for other families (Gemma's 1 + w, LayerNorm), which are refused, not approximated."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config", raw)
    if text.get("model_type", raw.get("model_type")) not in RMSNORM_MODEL_TYPES or "rms_norm_eps" not in text:
        return None
    return float(text["rms_norm_eps"])


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
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                count += _numel(f.get_slice(name).get_shape())
    return 4 * count


def _numel(shape: list[int]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
