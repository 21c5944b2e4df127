"""What a checkpoint directory holds, read from its small files only, before any engine starts.

vLLM finds a missing tokenizer, a cut-off weight file or a context shorter than the run's sequences only
while it loads the model: 20+ minutes into a Kimi-K2.5 job. These checks read `config.json`, the
tokenizer's config and each safetensors file's header (its first bytes), which takes milliseconds for
any size of model, and return `Problem`s naming the file and what to do.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from eagle3data.utils.problems import Problem

KEY = "model.path"
# config.json keys vLLM takes the context length from, the smallest found wins (its own list, in order).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# Rope types whose `factor` vLLM does not multiply the context by (it is scaled already, or differently).
UNSCALED_ROPE_TYPES = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
LISTED = 4  # names listed in a message about a directory's files


@dataclass(frozen=True)
class CheckpointFacts:
    """What the checks learned from the checkpoint's config and files."""

    config: dict  # the language model's config (a multimodal wrapper's text_config)
    context: int | None  # the longest sequence vLLM accepts (its max_model_len bound), None: not stated
    context_key: str  # where `context` comes from
    weight_bytes: int  # bytes of the weight files


def checkpoint_problems(path: str | Path, load_format: str = "auto") -> tuple[CheckpointFacts | None,
                                                                            list[Problem]]:
    """The facts of the checkpoint at `path` and its problems: a directory with config.json (the sizes
    the pipeline reads), weights (unless `load_format` is dummy) whose files are whole, a tokenizer and a
    chat template. Facts are None where config.json cannot be read."""
    path = Path(path)
    if not path.exists():
        return None, [Problem(KEY, f"{path} does not exist.",
                              "a local checkpoint directory (config.json, safetensors weights, a tokenizer "
                              "with a chat template)",
                              "point model.path at the checkpoint directory (a Hugging Face repo id is not "
                              "downloaded: `hf download <repo> --local-dir <dir>` first).")]
    if not path.is_dir():
        return None, [Problem(KEY, f"{path} is a file, not a directory.",
                              "a local checkpoint directory (config.json, weights, tokenizer)",
                              "point model.path at the directory that holds config.json.")]
    files = sorted(p.name for p in path.iterdir())
    if "config.json" not in files:
        return None, [Problem(KEY, f"{path} holds no config.json ({_listing(files)}).",
                              "a Hugging Face checkpoint directory: config.json, weights, tokenizer",
                              "point model.path at the directory with the model's config.json.")]
    raw, problem = _read_json(path / "config.json")
    if problem:
        return None, [problem]
    text = raw.get("text_config", raw) if isinstance(raw, dict) else raw
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size")
               if not isinstance(text, dict) or not isinstance(text.get(k), int)]
    if missing:
        return None, [Problem(f"{path / 'config.json'}", f"no integer {', '.join(missing)}.",
                              "a decoder language model's config (num_hidden_layers, hidden_size, vocab_size)",
                              "point model.path at a causal language model's checkpoint.")]
    problems = []
    weights, weight_problems = _weights(path, files, load_format)
    problems += weight_problems
    tokenizer_config, tok_problems = _tokenizer(path, files)
    problems += tok_problems
    context, key = context_length(text, tokenizer_config)
    return CheckpointFacts(text, context, key, weights), problems


def context_length(text_config: dict, tokenizer_config: dict | None) -> tuple[int | None, str]:
    """The longest sequence vLLM's engine accepts for this config (its derived max_model_len): the
    smallest of the config's length keys and the tokenizer's model_max_length, times the rope factor
    for the rope types whose length keys are unscaled."""
    found = [(text_config[k], f"config.json {k}") for k in CONTEXT_KEYS
             if isinstance(text_config.get(k), int | float) and not isinstance(text_config.get(k), bool)]
    if tokenizer_config and isinstance(tokenizer_config.get("model_max_length"), int | float):
        found.append((tokenizer_config["model_max_length"], "tokenizer_config.json model_max_length"))
    if not found:
        return None, "none of vLLM's length keys"
    length, key = min(found, key=lambda item: item[0])
    rope = text_config.get("rope_parameters") or text_config.get("rope_scaling") or {}
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if kind not in UNSCALED_ROPE_TYPES and isinstance(factor, int | float) and factor:
            length, key = length * factor, f"{key} x rope factor {factor}"
    return int(length), key


def _read_json(file: Path) -> tuple[dict | None, Problem | None]:
    try:
        return json.loads(file.read_text()), None
    except json.JSONDecodeError as exc:
        return None, Problem(f"{file}:{exc.lineno}", f"not valid JSON ({exc.msg}, column {exc.colno}).",
                             "the file as the model's publisher wrote it",
                             "download the file again, or fix the line.")
    except (OSError, UnicodeDecodeError) as exc:
        return None, Problem(str(file), f"cannot be read ({exc}).", "a readable UTF-8 JSON file",
                             "check the file's permissions and contents.")


def _weights(path: Path, files: list[str], load_format: str) -> tuple[int, list[Problem]]:
    """Bytes of the weight files, and problems: none at all, shards an index names that are absent, and
    safetensors files shorter than their header says (a download cut off)."""
    weights = [name for name in files if name.endswith(WEIGHT_SUFFIXES)]
    total = sum((path / name).stat().st_size for name in weights)
    if load_format == "dummy":  # random weights from config.json alone
        return total, []
    problems = []
    if not weights:
        return 0, [Problem(KEY, f"{path} holds no weights (*.safetensors): {_listing(files)}.",
                           "the model's weight files beside config.json",
                           "download the weights into the directory, or set engine.load_format: dummy for "
                           "random weights (smoke tests only).")]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data, problem = _read_json(index)
        if problem:
            problems.append(problem)
        else:
            named = sorted(set((data or {}).get("weight_map", {}).values()))
            absent = [name for name in named if name not in files]
            if absent:
                problems.append(Problem(
                    KEY, f"{len(absent)} of the {len(named)} weight files that {index.name} names are absent "
                    f"from {path}: {_listing(absent)}.", "every file the index names",
                    "finish the download (it resumes: `hf download <repo> --local-dir <dir>`)."))
    cut = []
    for name in weights:
        if name.endswith(".safetensors"):
            expected = _safetensors_size(path / name)
            if expected is not None and expected != (path / name).stat().st_size:
                cut.append(f"{name} ({(path / name).stat().st_size:,} of {expected:,} bytes)")
    if cut:
        problems.append(Problem(KEY, f"{len(cut)} weight file(s) shorter than their header says: {_listing(cut)}.",
                                "whole safetensors files", "download these files again."))
    return total, problems


def _safetensors_size(file: Path) -> int | None:
    """The size a safetensors file has when whole, from its header; None where the header is unreadable
    (the file is then shorter than 8 bytes or no safetensors file: its size says 0)."""
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return 8
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    return 8 + n + max(ends, default=0)


def _tokenizer(path: Path, files: list[str]) -> tuple[dict | None, list[Problem]]:
    """tokenizer_config.json (or None) and problems: no tokenizer files, no chat template."""
    config = None
    if "tokenizer_config.json" in files:
        config, problem = _read_json(path / "tokenizer_config.json")
        if problem:
            return None, [problem]
    has_tokenizer = any(name in files for name in TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in files)
    if not has_tokenizer and not (config or {}).get("auto_map"):
        return config, [Problem(KEY, f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES[:3])}, ...).",
                                "the tokenizer the model was trained with, beside config.json",
                                "copy the tokenizer files (and tokenizer_config.json) into the directory.")]
    template = (config or {}).get("chat_template")
    if not template and "chat_template.jinja" not in files and "chat_template.json" not in files:
        return config, [Problem(KEY, f"{path} holds no chat template (tokenizer_config.json chat_template, "
                                "chat_template.jinja): every conversation would be skipped.",
                                "the chat template the target is served with",
                                "add the model's chat_template.jinja (an instruct model ships one).")]
    return config, []


def _listing(names: list[str]) -> str:
    if not names:
        return "it is empty"
    shown = ", ".join(names[:LISTED])
    return shown + (f" and {len(names) - LISTED} more" if len(names) > LISTED else "")
