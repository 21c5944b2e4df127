"""Snakemake script for rule pack: eagle3data.rule_jobs.pack, in a child of the node's warm job
server (eagle3data.warm_jobs) when one answers."""

from eagle3data.warm_jobs import run

run("eagle3data.rule_jobs:pack", snakemake)  # noqa: F821
