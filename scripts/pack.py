"""Snakemake script for rule pack (the dataset over the packed shards): see eagle3data.index."""

from eagle3data.index import IndexJob, index
from eagle3data.logs import redirect_output_to
from eagle3data.settings import Settings

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
settings = Settings(dict(sm.config))
index(
    IndexJob(
        summaries=list(sm.input.summaries),
        skipped=list(sm.input.skipped),
        quarantined=list(sm.input.quarantined),
        out_dir=sm.output.dataset,
        counts_out=sm.output.counts,
        conversations_in=sm.params.conversations_in,
        metadata=settings.dataset_metadata(),
        store_dir=str(settings.store_dir),
    )
)
