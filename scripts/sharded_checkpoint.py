"""Snakemake script for rule sharded_checkpoint: see eagle3data.checkpoint."""

from eagle3data.jobinfo import start_job
from eagle3data.logs import redirect_output_to

if __name__ == "__main__":
    sm = snakemake  # noqa: F821
    redirect_output_to(sm.log[0])
    from eagle3data.engine_pool import stop_idle

    stop_idle()  # an idle engine of this node may hold the GPUs
    start_job(sm.resources.gpu)  # claims this job's GPUs: before anything starts CUDA
    from eagle3data.checkpoint import write_sharded

    model = sm.params.model
    write_sharded(model["path"], model["dtype"], dict(sm.config["engine"]), model["trust_remote_code"],
                  sm.output.checkpoint)
