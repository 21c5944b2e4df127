"""Snakemake script for rule pack_shard: see eagle3data.rule_jobs.pack_shard."""

from eagle3data.rule_jobs import pack_shard

pack_shard(snakemake)  # noqa: F821
