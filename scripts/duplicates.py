"""Snakemake script for rule cross_shard_duplicates: see eagle3data.dataset.duplicates."""

from eagle3data.dataset.duplicates import write_index
from eagle3data.utils.logs import get_logger, redirect_output_to

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
index = write_index(list(sm.input.tokenized), sm.output.index)
get_logger(__name__).info("%d conversations are held by more than one of %d shards", len(index),
                          len(sm.input.tokenized))
