"""Snakemake script for rule validate: eagle3data.rule_jobs.validate, in a child of the node's warm job
server (eagle3data.warm_jobs) when one answers."""

from eagle3data.warm_jobs import run

run("eagle3data.rule_jobs:validate", snakemake)  # noqa: F821
