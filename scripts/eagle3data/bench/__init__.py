"""Benchmarks and engine checks, kept apart from the pipeline's stages: `python -m eagle3data.bench`.

Each figure measures a stage against its own limit in one run (see docs/benchmarks.md); the crosscheck
compares the pipeline's captured states with transformers' on a GPU machine.
"""
