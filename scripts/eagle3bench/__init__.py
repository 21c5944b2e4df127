"""Benchmarks and engine checks of eagle3data, beside it: `python -m eagle3bench`. They import the
library, which never imports them, and are a distribution of their own (pyproject.toml here): the
eagle3data wheel does not hold them, and they run from a checkout.

Each figure measures a stage against its own limit in one run (see docs/benchmarks.md); the crosscheck
compares the pipeline's captured states with transformers' on a GPU machine.
"""
