"""Snakemake script for rule vocab: see eagle3data.exports.vocab."""

from eagle3data.utils.logs import redirect_output_to
from eagle3data.config.settings import Settings
from eagle3data.exports.vocab import write_vocab

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
write_vocab(
    dataset_path=sm.input.dataset,
    model_path=sm.params.model_path,
    draft_vocab_size=Settings(dict(sm.config)).draft_vocab_size,
    token_freq_out=sm.output.token_freq,
    mapping_out=sm.output.mapping,
)
