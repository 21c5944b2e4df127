"""Snakemake script for rule pack_shard: see eagle3data.pack.pack_shard."""

from eagle3data.logs import redirect_output_to
from eagle3data.pack import ShardPackJob, pack_shard
from eagle3data.packed import packed_shard_path
from eagle3data.settings import Settings

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
settings = Settings(dict(sm.config))
pack_shard(
    ShardPackJob(
        tokenized=sm.input.tokenized,
        skipped=sm.input.skipped,
        states=sm.input.states,
        quarantined=sm.input.quarantined,
        duplicates=sm.input.duplicates,
        shard=int(sm.wildcards.shard),
        arrow=str(packed_shard_path(settings.store_dir, sm.wildcards.shard)),
        summary=sm.output.summary,
        metadata=settings.dataset_metadata(),
        dataset=sm.params.dataset,
        dataset_counts=sm.params.counts,
        storage=dict(sm.config["storage"]),
        store_dir=str(settings.store_dir),
        samples_dir=str(settings.samples_dir),
    )
)
