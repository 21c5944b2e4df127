"""Tokenizing a regenerated shard: what regenerate wrote, read back as the tokenize stage reads input rows.

A regenerated shard (regenerate/stage.py) holds one JSON line per kept conversation, `{source_row, record}`,
the record in OpenAI `messages` form with `reasoning_content` / `tool_calls` where the target produced
them; the conversations regenerate skipped are listed, with their reasons, in its stats. Both come back
here: the kept ones are tokenized under their original input row numbers and the skipped ones join the
tokenize stage's skipped table, so pack's counts reconcile against the input as without regeneration.
"""

from __future__ import annotations

import json

import pandas as pd

from eagle3data.inputs.tokenization import tokenize_records, write_tables


def read_rows(path: str) -> list[dict]:
    """The regenerated shard as tokenize_records' rows: `{source_row, record}` with the record as JSON."""
    with open(path) as f:
        return [{"source_row": doc["source_row"], "record": json.dumps(doc["record"])}
                for doc in map(json.loads, f)]


def tokenize_regenerated(tokenizer, conversations: str, stats: str, sequence: dict, tokenized_out: str,
                         skipped_out: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    rows = read_rows(conversations)
    kept, skipped = tokenize_records(tokenizer, rows, sequence["max_seq_len"], sequence["min_seq_len"])
    regenerate_skipped = pd.DataFrame(json.loads(open(stats).read())["skipped_rows"], columns=skipped.columns)
    skipped = pd.concat([skipped, regenerate_skipped], ignore_index=True).sort_values("source_row")
    return write_tables(kept, skipped, tokenized_out, skipped_out, conversations)
