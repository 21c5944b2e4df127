"""Snakemake script for rule preflight: see eagle3data.config.preflight. The report goes to the terminal and
to the rule's log. A model built by the workflow is checked here first (the run's own check found none
to check before it was built)."""

import sys
from pathlib import Path

from eagle3data.config.preflight import report
from eagle3data.config.problems import render
from eagle3data.config.run_check import Where, model_problems

sm = snakemake  # noqa: F821
config = dict(sm.config)
problems = model_problems(config, Where(local=False))
text = render(problems) if problems else report(config, sm.params.schema)
Path(sm.log[0]).write_text(text + "\n")
print(text, file=sys.stderr if problems else sys.stdout, flush=True)
if problems:
    sys.exit(1)
