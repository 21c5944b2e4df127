"""Snakemake script for rule regenerate: see eagle3data.regenerate.stage."""

from eagle3data.engine.jobinfo import start_job
from eagle3data.engine.pool import claim_gpus
from eagle3data.engine.reaper import guard
from eagle3data.utils.logs import redirect_output_to

if __name__ == "__main__":
    sm = snakemake  # noqa: F821
    redirect_output_to(sm.log[0])
    guard("regenerate job")  # its vLLM engine core and workers die with it, whatever ends it
    # This job's GPUs, before anything starts CUDA; an idle capturing engine of this user holding them
    # is stopped, nothing else (engine/pool.py).
    start_job(sm.resources.gpu, claimed=claim_gpus(sm.resources.gpu))
    from eagle3data.regenerate.stage import RegenerateJob, RegenerateSettings, run
    from eagle3data.config.settings import Settings

    settings = Settings(dict(sm.config))
    run(
        RegenerateJob(
            conversations=sm.input.conversations,
            rows=tuple(sm.params.rows),
            out=sm.output.conversations,
            responses=sm.output.responses,
            stats=sm.output.stats,
            journal=sm.params.journal,
            model_path=sm.params.model["path"],
            trust_remote_code=sm.params.model["trust_remote_code"],
            dtype=settings.dtype,
            max_seq_len=sm.params.max_seq_len,
            engine=settings.engine,  # read at run time: engine settings do not change the data
            settings=RegenerateSettings.from_config(sm.params.settings),
            chat_template_kwargs=dict(sm.params.model["chat_template_kwargs"]),
        )
    )
