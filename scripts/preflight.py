"""Snakemake script for rule preflight: see eagle3data.config.preflight. The report goes to the terminal and
to the rule's log."""

from pathlib import Path

from eagle3data.config.preflight import report

sm = snakemake  # noqa: F821
text = report(dict(sm.config), sm.params.schema)
Path(sm.log[0]).write_text(text + "\n")
print(text, flush=True)
