"""Snakemake script for rule regenerate_report: see eagle3data.report.regenerate."""

from eagle3data.utils.logs import redirect_output_to
from eagle3data.report.regenerate import write_regenerate_report

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
write_regenerate_report(list(sm.input.responses), list(sm.input.stats), sm.output.summary, sm.output.lengths)
