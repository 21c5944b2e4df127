"""Snakemake script for rule export_speculators: see eagle3data.exports.speculators."""

from eagle3data.exports.speculators import export
from eagle3data.utils.logs import redirect_output_to
from eagle3data.config.settings import Settings

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
export(
    dataset_path=sm.input.dataset,
    out=sm.output.export,
    token_freq=sm.input.token_freq,
    vocab_mapping=sm.input.mapping,
    layer_ids=sm.params.layer_ids,
    store_dir=Settings(dict(sm.config)).store.samples,
    states=sm.params.states,
    storage=sm.config["storage"],
)
