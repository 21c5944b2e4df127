"""Snakemake script for rule report: see eagle3data.report.pages."""

from eagle3data.utils.logs import redirect_output_to
from eagle3data.report.pages import write_report

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
write_report(
    counts=sm.input.counts,
    tokenized=list(sm.input.tokenized),
    states=list(sm.input.states),
    stats=list(sm.input.stats),
    out=sm.output,
)
