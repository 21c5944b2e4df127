"""Host memory the jobs declare (their `mem_mb`, what SLURM allocates). An extract or regenerate job: a
base plus a share per engine GPU. A validate job: its own needs plus the parity gate's float32 reference
of the checkpoint's first layers, which for a model of a few billion parameters is most of it. Planned
from the checkpoint's safetensors headers when the workflow is read; a model a rule builds (the demo) is
small and not there yet: the base alone. So is a checkpoint or a capture list the start's checks refuse
(config.run_check.model_problems, in a screen before any job): planning does not pre-empt them with a
traceback."""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import SafetensorError

from eagle3data.contracts.layers import eagle3_captures, parse_captures
from eagle3data.engine.start import EngineSettings
from eagle3data.model.info import read_model_info
from eagle3data.model.weights import reference_layers

ENGINE_BASE_MB = 4000  # the job, its engine's host side and a CPU engine's model
ENGINE_GPU_MB = 16000  # a CUDA engine's host memory per GPU (its worker process, pinned buffers)
VALIDATE_BASE_MB = 4000  # reading, measuring and the gate's output head in chunks
REFERENCE_MARGIN = 1.25  # activations and the loader's copies beside the float32 weights


def engine_job_mb(engine: EngineSettings) -> int:
    """The memory on its first attempt, MB, of a job that runs an engine (extract, regenerate); it grows
    with each retry (mem_mb x attempt), so a job killed for memory comes back with more."""
    return ENGINE_BASE_MB + (ENGINE_GPU_MB * engine.tensor_parallel_size if engine.device == "cuda" else 0)


def validate_mb(config: dict) -> int:
    """The memory on its first attempt, MB, of a validate job that runs the reference (the first
    `parity.reference_shards` shards'; the others take VALIDATE_BASE_MB)."""
    parity, model = config["parity"], Path(config["model"]["path"])
    if not parity["enabled"] or not parity["reference_shards"] or not (model / "config.json").is_file():
        return VALIDATE_BASE_MB
    try:
        layers = read_model_info(model).num_hidden_layers
        captures = parse_captures(config["captures"] or eagle3_captures(layers), layers)
        _, need, _ = reference_layers(model, [c.stream_index for c in captures],
                                      parity["reference_memory_gib"] * 2**30)
    except (ValueError, LookupError, OSError, SafetensorError):  # told by the start's checks
        return VALIDATE_BASE_MB
    return VALIDATE_BASE_MB + math.ceil(need * REFERENCE_MARGIN / 1e6)
