"""Snakemake script for rule demo_model: see eagle3data.model.demo."""

from pathlib import Path

from eagle3data.utils.logs import redirect_output_to
from eagle3data.model.demo import build_demo_model

redirect_output_to(snakemake.log[0])  # noqa: F821
build_demo_model(Path(snakemake.input.conversations), Path(snakemake.output.model))  # noqa: F821
