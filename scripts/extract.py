"""Snakemake script for rule extract: see eagle3data.capture.extract."""

from eagle3data.engine.jobinfo import start_job
from eagle3data.engine.reaper import guard
from eagle3data.utils.logs import redirect_output_to

if __name__ == "__main__":
    sm = snakemake  # noqa: F821
    redirect_output_to(sm.log[0])
    guard("extract job")  # anything it starts in its session dies with it (its engine server has its own)
    start_job(sm.resources.gpu, claim=False)  # the engine server this job may start claims the GPUs
    from eagle3data.inputs.conversations import count_conversations
    from eagle3data.plan.disk import InputShape
    from eagle3data.capture.extract import ExtractJob, run
    from eagle3data.config.settings import Settings
    from eagle3data.plan.shards import plan

    settings = Settings(dict(sm.config))
    start, stop = sm.params.rows
    # Read at run time, not passed as params: a growing input, engine or storage settings (which do not
    # change the data) must not re-run finished jobs.
    conversations = count_conversations(sm.config["input"])
    rows = plan(conversations, sm.config["shard_size"])
    shape = InputShape(stop - start, conversations, tuple(rows))
    run(
        ExtractJob(
            tokenized=sm.input.tokenized,
            manifest=sm.output.manifest,
            stats=sm.output.stats,
            store=settings.store,
            model_path=sm.params.model["path"],
            trust_remote_code=sm.params.model["trust_remote_code"],
            expected=settings.expected,
            max_seq_len=sm.params.sequence["max_seq_len"],
            engine=settings.engine,
            input_shape=shape,
            parity_samples=sm.config["parity"]["samples_per_shard"] if sm.config["parity"]["enabled"] else 0,
            gpus=sm.resources.gpu,
        )
    )
