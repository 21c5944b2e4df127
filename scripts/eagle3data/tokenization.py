"""Render conversations with the target's chat template and mark assistant tokens for the loss.

The mask is computed without knowing the template: render the conversation up to each assistant turn
(with the generation prompt) and up to its end; the text between is the assistant's, whatever markers
the template uses. The rendered text is cut at those boundaries and each piece is tokenized on its own,
so no offset mapping is needed (Kimi's tiktoken-based slow tokenizer has none). Pieces are joined at
message boundaries, where templates put special tokens, so the ids equal a whole-text tokenization in
practice; the `matches_full_tokenization` column records where they do not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pandas as pd

from eagle3data import conversations
from eagle3data.conversations import UnsupportedInput, normalize_messages, sample_id
from eagle3data.logs import get_logger
from eagle3data.schemas import SkippedShard, TokenizedShard, check
from eagle3data.store import atomic_path

logger = get_logger(__name__)


class SkipSample(Exception):
    """A conversation that yields no training sample; the message is the recorded reason."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    matches_full_tokenization: bool


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))


def assistant_spans(tokenizer, messages: list[dict], tools=None) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the character spans [start, end) of each assistant turn."""
    full = _render(tokenizer, messages, tools, add_generation_prompt=False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], tools, add_generation_prompt=True)
        through = _render(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise SkipSample(
                "template_not_prefix_stable: rendering the first turns is not a prefix of rendering "
                f"the whole conversation (turn {k}); the template rewrites earlier turns"
            )
        if spans and len(before) < spans[-1][1]:
            raise SkipSample(f"template_not_prefix_stable: turn {k} starts before the previous ends")
        spans.append((len(before), len(through)))
    return full, spans


def tokenize_conversation(tokenizer, messages: list[dict], tools=None) -> Tokenized:
    """Token ids of the rendered conversation and a 0/1 mask of the assistant's tokens."""
    full, spans = assistant_spans(tokenizer, messages, tools)
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for start, end in spans:
        piece = _encode(tokenizer, full[cursor:start])
        ids += piece
        mask += [0] * len(piece)
        piece = _encode(tokenizer, full[start:end])
        ids += piece
        mask += [1] * len(piece)
        cursor = end
    piece = _encode(tokenizer, full[cursor:])
    ids += piece
    mask += [0] * len(piece)
    return Tokenized(ids, mask, ids == _encode(tokenizer, full))


def tokenize_shard(tokenizer, conversations_path: str, rows: tuple[int, int], sequence: dict,
                   tokenized_out: str, skipped_out: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The tokenize stage: input rows [start, stop) tokenized; both tables checked, written atomically."""
    start, stop = rows
    kept, skipped = tokenize_records(tokenizer, conversations.read_shard(conversations_path, start, stop),
                                     sequence["max_seq_len"], sequence["min_seq_len"])
    kept = check(TokenizedShard, kept, tokenized_out)
    skipped = check(SkippedShard, skipped, skipped_out)
    for path, frame in ((tokenized_out, kept), (skipped_out, skipped)):
        with atomic_path(path) as tmp:
            frame.to_parquet(tmp, index=False)
    logger.info("rows %d..%d: %d samples, %d skipped %s", start, stop, len(kept), len(skipped),
                skipped["reason"].value_counts().to_dict())
    return kept, skipped


def tokenize_records(
    tokenizer, rows, max_seq_len: int, min_seq_len: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Tokenize input rows ({source_row, record}); return (kept samples, skipped samples with reasons)."""
    kept, skipped = [], []
    for row in rows:
        record = json.loads(row["record"])
        source = {"source_row": row["source_row"], "source_id": str(record.get("id", ""))}
        try:
            messages = normalize_messages(record)
            tools = record.get("tools")
            sid = sample_id(messages, tools)
        except UnsupportedInput as exc:
            skipped.append({"sample_id": sample_id([{"raw": record}]), **source, "reason": str(exc)})
            continue
        try:
            sample = _to_sample(tokenizer, messages, tools, max_seq_len, min_seq_len)
        except SkipSample as exc:
            skipped.append({"sample_id": sid, **source, "reason": str(exc)})
            continue
        kept.append({"sample_id": sid, **source, **sample})
    kept_df = pd.DataFrame(kept, columns=KEPT_COLUMNS)
    skipped_df = pd.DataFrame(skipped, columns=["sample_id", "source_row", "source_id", "reason"])
    return kept_df, skipped_df


KEPT_COLUMNS = [
    "sample_id",
    "source_row",
    "source_id",
    "input_ids",
    "loss_mask",
    "num_tokens",
    "num_trainable",
    "truncated",
    "matches_full_tokenization",
]


def _to_sample(tokenizer, messages, tools, max_seq_len: int, min_seq_len: int) -> dict:
    if not messages:
        raise SkipSample("empty_conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipSample("no_assistant_turn")
    try:
        tokenized = tokenize_conversation(tokenizer, messages, tools)
    except SkipSample:
        raise
    except Exception as exc:  # a template that raises on this conversation
        raise SkipSample(f"template_error: {type(exc).__name__}: {exc}") from exc
    ids, mask = tokenized.input_ids, tokenized.loss_mask
    truncated = len(ids) > max_seq_len
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    if sum(mask) == 0:
        raise SkipSample(
            "no_trainable_tokens_after_truncation" if truncated else "no_trainable_tokens"
        )
    if len(ids) < min_seq_len:
        raise SkipSample(f"shorter_than_min_seq_len ({len(ids)} < {min_seq_len})")
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "num_tokens": len(ids),
        "num_trainable": sum(mask),
        "truncated": truncated,
        "matches_full_tokenization": tokenized.matches_full_tokenization,
    }
