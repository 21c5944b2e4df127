"""Snakemake script for rule gguf_model: see eagle3data.model.gguf."""

from pathlib import Path

from eagle3data.model.gguf import build_from_gguf
from eagle3data.utils.logs import redirect_output_to

redirect_output_to(snakemake.log[0])  # noqa: F821
build_from_gguf(snakemake.params.package, snakemake.params.file, Path(snakemake.output.model))  # noqa: F821
