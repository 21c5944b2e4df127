"""Facts about the target checkpoint, read from its config.json before any engine starts.

Checking them first turns a wrong path or a wrong expectation (hidden size, layer count) into an error
in seconds instead of after a 20-minute model load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelInfo:
    path: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    uses_mla: bool
    identity: str  # hash of config.json and the weight files' names and sizes


def read_model_info(path: str | Path) -> ModelInfo:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelConfigError(f"model: no config.json in {path} (model.path must be a local checkpoint)")
    raw = json.loads(config_file.read_text())
    text = raw.get("text_config", raw)  # multimodal wrappers (Kimi-K2.5) nest the language model
    weights = sorted((p.name, p.stat().st_size) for p in path.glob("*.safetensors"))
    identity = hashlib.sha256(json.dumps([raw, weights], sort_keys=True).encode()).hexdigest()[:16]
    return ModelInfo(
        path=str(path.resolve()),
        model_type=text.get("model_type", raw.get("model_type", "?")),
        num_hidden_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        uses_mla=text.get("kv_lora_rank") is not None,
        identity=identity,
    )


def check_expectations(info: ModelInfo, hidden_size: int | None, num_hidden_layers: int | None) -> None:
    """Compare the config's expectations with the checkpoint; raise naming both values."""
    for name, expected, found in (
        ("hidden_size", hidden_size, info.hidden_size),
        ("num_hidden_layers", num_hidden_layers, info.num_hidden_layers),
    ):
        if expected is not None and expected != found:
            raise ModelConfigError(
                f"model.{name}: config expects {expected}, the checkpoint at {info.path} has {found}"
            )
