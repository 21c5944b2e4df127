"""Snakemake script for rule tokenize: see eagle3data.inputs.tokenization."""

from eagle3data.utils.logs import redirect_output_to
from eagle3data.inputs.tokenization import load_tokenizer, tokenize_shard

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])

tokenizer = load_tokenizer(sm.params.model_path, sm.params.trust_remote_code, sm.params.chat_template_kwargs)
if "regenerated" in sm.input.keys():  # regenerate.enabled: the shard's regenerated conversations
    from eagle3data.regenerate.tokenize import tokenize_regenerated

    tokenize_regenerated(tokenizer, sm.input.conversations, sm.input.regenerated, sm.params.sequence,
                         sm.output.tokenized, sm.output.skipped)
else:
    tokenize_shard(tokenizer, sm.input.conversations, sm.params.rows, sm.params.sequence,
                   sm.output.tokenized, sm.output.skipped)
