"""Snakemake script for rule pack: see eagle3data.rule_jobs.pack."""

from eagle3data.rule_jobs import pack

pack(snakemake)  # noqa: F821
