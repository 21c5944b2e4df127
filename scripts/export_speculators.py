"""Snakemake script for rule export_speculators: see eagle3data.export_speculators."""

from eagle3data.export_speculators import export
from eagle3data.logs import redirect_output_to
from eagle3data.settings import Settings

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
export(
    dataset_path=sm.input.dataset,
    out=sm.output.export,
    token_freq=sm.input.token_freq,
    vocab_mapping=sm.input.mapping,
    layer_ids=sm.params.layer_ids,
    store_dir=Settings(dict(sm.config)).samples_dir,
    states=sm.params.states,
)
