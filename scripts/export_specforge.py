"""Snakemake script for rule export_specforge: see eagle3data.exports.specforge."""

from eagle3data.exports.specforge import export
from eagle3data.utils.logs import redirect_output_to

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
export(
    dataset_path=sm.input.dataset,
    out=sm.output.export,
    model_path=sm.params.model_path,
    vocab_mapping=sm.input.mapping,
    layer_ids=sm.params.layer_ids,
    states=sm.params.states,
    storage=sm.config["storage"],
)
