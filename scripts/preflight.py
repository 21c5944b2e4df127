"""Snakemake script for rule preflight: see eagle3data.config.preflight. The report goes to the terminal and
to the rule's log, then any problem it found (the free disk), and the job fails when there is one. A model
built by the workflow is checked here first: the run's own check found none to check before the build."""

import sys
from pathlib import Path

from eagle3data.config.preflight import report
from eagle3data.utils.problems import render
from eagle3data.config.run_check import Where, model_problems

sm = snakemake  # noqa: F821
config = dict(sm.config)
problems = model_problems(config, Where(local=False))
text = ""
if not problems:
    text, problems = report(config, sm.params.schema)
    print(text, flush=True)
if problems:
    text += ("\n" if text else "") + render(problems)
    print(render(problems), file=sys.stderr, flush=True)
Path(sm.log[0]).write_text(text + "\n")
sys.exit(1 if problems else 0)
