"""Snakemake script for rule validate: see eagle3data.validate."""

from eagle3data.logs import redirect_output_to
from eagle3data.settings import Settings
from eagle3data.validate import run

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
run(sm.input.tokenized, sm.input.manifest, sm.output.states, Settings(dict(sm.config)).expected)
