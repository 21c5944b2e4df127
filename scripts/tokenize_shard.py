"""Snakemake script for rule tokenize: see eagle3data.tokenization."""

from eagle3data.logs import get_logger, redirect_output_to
from eagle3data.schemas import SkippedShard, TokenizedShard, check
from eagle3data.store import atomic_path

from eagle3data import conversations
from eagle3data.tokenization import tokenize_records

sm = snakemake  # noqa: F821
redirect_output_to(sm.log[0])
logger = get_logger("tokenize")

from transformers import AutoTokenizer  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(
    sm.params.model_path, trust_remote_code=sm.params.trust_remote_code
)
start, stop = sm.params.rows
rows = conversations.read_shard(sm.input.conversations, start, stop)
kept, skipped = tokenize_records(
    tokenizer, rows, sm.params.sequence["max_seq_len"], sm.params.sequence["min_seq_len"]
)
kept = check(TokenizedShard, kept, sm.output.tokenized)
skipped = check(SkippedShard, skipped, sm.output.skipped)
for path, frame in ((sm.output.tokenized, kept), (sm.output.skipped, skipped)):
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)
logger.info(
    "rows %d..%d: %d samples, %d skipped %s",
    start, stop, len(kept), len(skipped), skipped["reason"].value_counts().to_dict(),
)
