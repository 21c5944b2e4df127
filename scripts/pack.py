"""Snakemake script for rule pack: see eagle3data.pack."""

from eagle3data.logs import redirect_output_to
from eagle3data.pack import PackJob, run
from eagle3data.settings import Settings

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
run(
    PackJob(
        tokenized=list(sm.input.tokenized),
        skipped=list(sm.input.skipped),
        states=list(sm.input.states),
        quarantined=list(sm.input.quarantined),
        out_dir=sm.output.dataset,
        counts_out=sm.output.counts,
        conversations_in=sm.params.conversations_in,
        metadata=Settings(dict(sm.config)).dataset_metadata(),
        storage=dict(sm.config["storage"]),
    )
)
