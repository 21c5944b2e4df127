# Config validation, shard bookkeeping and paths shared by every rule.
import glob

from snakemake.utils import min_version

min_version("9.27")

from eagle3data.utils.problems import stop_on
from eagle3data.config.run_check import Where, plan_problems, start_problems
from eagle3data.config.settings import data_params, packing_params, regeneration_params
from eagle3data.inputs.conversations import count_conversations
from eagle3data.engine.start import EngineSettings
from eagle3data.plan.memory import VALIDATE_BASE_MB, engine_job_mb, validate_mb
from eagle3data.plan.shards import plan

# Every problem of the config and the input, told at once in a few lines each, before any job (and in
# dry runs); the main process reads every input line, a job's own planning only counts them.
PLANNED, PROBLEMS = plan_problems(
    config,
    workflow.source_path("../config/schema.yaml"),
    scan_input=workflow.is_main_process,
)
stop_on(PROBLEMS)

RUN = config["run"]
# What determines the states: params of extract and (but the loader) validate, so a change re-runs them.
DATA_PARAMS = data_params(config)
CHECKED_PARAMS = data_params(config, loader=False)
# What shapes regenerated answers: params of regenerate, so a change generates them again.
REGENERATION_PARAMS = regeneration_params(config)
# How the packed rows store them: params of pack_shard, so a new codec, level or precision packs again.
PACKING_PARAMS = packing_params(config)
RUN_DIR = f"results/{RUN}"
N_CONVERSATIONS = (
    PLANNED.rows if PLANNED.rows is not None else count_conversations(config["input"])
)
SHARD_ROWS = plan(N_CONVERSATIONS, config["shard_size"])
N_SHARDS = len(SHARD_ROWS)
SHARDS = [f"{i:05d}" for i in range(N_SHARDS)]
# One engine per extract job: data-parallel engines are extract jobs scheduled side by side. Its host
# memory on attempt 1 grows with each retry (mem_mb x attempt; --retries), so a job killed for memory
# comes back with more, and reuses the samples it finished. profiles/slurm sets its own
# (EAGLE3_SLURM_EXTRACT_MEM_MB).
ENGINE = EngineSettings.from_config(config["engine"])
GPUS_PER_EXTRACT = ENGINE.job_gpus
EXTRACT_MEM_MB = engine_job_mb(ENGINE)


# Host memory of one validate job on attempt 1, MB: with the parity gate's reference in the first
# parity.reference_shards shards (plan/memory.py).
VALIDATE_REFERENCE_MEM_MB = validate_mb(config)


def validate_mem_mb(wildcards, attempt):
    reference = int(wildcards.shard) < config["parity"]["reference_shards"]
    return (VALIDATE_REFERENCE_MEM_MB if reference else VALIDATE_BASE_MB) * attempt


# `gpu` counts the GPUs of one node: it caps a local run (--resources gpu=8, profiles/default), never a
# cluster run as a whole (SLURM hands out the GPUs of all its nodes; the cap would serialise them).
resource_scopes:
    gpu="local",


def shard_rows(wildcards):
    """Input rows [start, stop) of a shard (eagle3data.plan.shards: contiguous ranges)."""
    return SHARD_ROWS[int(wildcards.shard)]


def model_source(wildcards):
    """A model built by a rule (the demo model, a GGUF conversion) is a DAG input; a checkpoint given by
    model.path alone is read in place (not a DAG input, so dry runs plan without it)."""
    model = config["model"]
    return [model["path"]] if model["build_demo"] or model["from_gguf"] else []


def quarantine_records(wildcards):
    """Reason files of the shard's samples that validate quarantined (validation.policy: quarantine):
    inputs of extract, newer than its outputs after a quarantine, so the next run re-extracts the shard
    (computing the samples whose files were moved out of the store) and validates it again.
    """
    return sorted(
        glob.glob(f"{RUN_DIR}/quarantine/shard-{wildcards.shard}/*.reason.txt")
    )


def tokenize_conversations(wildcards):
    """What tokenize reads: the input rows, or the shard's regenerated conversations and their stats."""
    if not config["regenerate"]["enabled"]:
        return {"conversations": config["input"]}
    return {
        "conversations": rules.regenerate.output.conversations.format(**wildcards),
        "regenerated": rules.regenerate.output.stats.format(**wildcards),
    }


def check_before_jobs():
    """The Snakefile's onstart: every problem the first jobs would meet (the vLLM build, the device, the
    config against the checkpoint, the GPUs this run may use), told before any job starts.
    """
    gpus = workflow.global_resources.get("gpu")
    gpus = getattr(gpus, "value", gpus)
    where = Where(
        gpus=gpus if isinstance(gpus, int) else None, local=workflow.local_exec
    )
    stop_on(start_problems(config, where))
