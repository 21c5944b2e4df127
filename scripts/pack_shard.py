"""Snakemake script for rule pack_shard: eagle3data.rule_jobs.pack_shard, in a child of the node's warm job
server (eagle3data.warm_jobs) when one answers."""

from eagle3data.warm_jobs import run

run("eagle3data.rule_jobs:pack_shard", snakemake)  # noqa: F821
