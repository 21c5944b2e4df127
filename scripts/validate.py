"""Snakemake script for rule validate: see eagle3data.rule_jobs.validate."""

from eagle3data.rule_jobs import validate

validate(snakemake)  # noqa: F821
