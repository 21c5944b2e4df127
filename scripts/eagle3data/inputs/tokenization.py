"""Render conversations with the target's chat template and mark assistant tokens for the loss.

The mask is computed without knowing the template: render the conversation up to each assistant turn
(with the generation prompt) and up to its end; the text between is the assistant's, whatever markers
the template uses (its reasoning and tool calls included). The rendered text is cut at those boundaries
and each piece is tokenized on its own, so no offset mapping is needed (Kimi's tiktoken-based slow
tokenizer has none). Pieces are joined at message boundaries, where templates put special tokens, so
the ids equal a whole-text tokenization in practice; the `matches_full_tokenization` column records
where they do not.

Templates that rewrite earlier turns once later ones exist (Qwen3 drops the reasoning of turns before
the last user message, Kimi-K2 gives history turns an empty `<think></think>`) keep a turn as the model
wrote it only while that turn is the last. Such a conversation becomes several samples: the whole
conversation trains the turns its full rendering keeps, and each other turn is trained in the
conversation cut after it, rendered as the template renders it when that turn is the last (turns that
the same cut keeps share one sample). Every assistant turn is trained exactly once; earlier turns are
context (mask 0) in the later samples. Each sample has its own id and is counted on its own.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import pandas as pd

from eagle3data.inputs import conversations
from eagle3data.inputs.conversations import UnsupportedInput, normalize, sample_id
from eagle3data.utils.logs import get_logger
from eagle3data.contracts.schemas import SkippedShard, TokenizedShard, check
from eagle3data.storage.store import atomic_path

logger = get_logger(__name__)
DUPLICATE = "duplicate_conversation"


class SkipSample(Exception):
    """A conversation or sample that yields no training sample; the message is the recorded reason,
    its kind before the first ':'."""


@dataclass
class Tokenized:
    input_ids: list[int]
    loss_mask: list[int]
    matches_full_tokenization: bool


@dataclass
class Turn:
    """A trained assistant turn: its characters in the sample's text, and what its tokens are."""
    index: int
    start: int
    end: int
    reasoning_not_rendered: bool = False
    reasoning_tokens: int = 0
    tool_call_tokens: int = 0
    first_token: int = 0  # where the turn's tokens are in the sample
    n_tokens: int = 0


@dataclass
class Sample:
    """One training sample of a conversation: `messages[:end]` rendered, `turns` trained."""
    end: int
    text: str
    turns: list[Turn]


def with_template_kwargs(tokenizer, kwargs: dict):
    """The tokenizer with `kwargs` (config `model.chat_template_kwargs`, e.g. a thinking switch) given to
    every chat-template rendering: tokenize renders a conversation as the target is served with them, and
    as regenerate prompted it."""
    if kwargs:
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **kwargs)
    return tokenizer


def load_tokenizer(path: str, trust_remote_code: bool, template_kwargs: dict):
    """The target's tokenizer as tokenize and preflight render with it (with_template_kwargs)."""
    from transformers import AutoTokenizer

    return with_template_kwargs(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code),
                                template_kwargs)


def _render(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> str:
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))


def plan_samples(tokenizer, messages: list[dict], tools=None) -> list[Sample]:
    """The samples of a conversation (see the module docstring), in order of their end."""
    turns = {}
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], tools, add_generation_prompt=True)
        through = _render(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
        if not through.startswith(before):
            raise SkipSample(
                f"template_not_prefix_stable: the generation prompt before turn {k} is not how the template "
                "begins that turn"
            )
        turns[k] = (before, through)
    full = _render(tokenizer, messages, tools, add_generation_prompt=False)
    if tools and full == _render(tokenizer, messages, None, add_generation_prompt=False):
        raise SkipSample("template_ignores_tools: the chat template renders nothing for the tools list")
    groups = [(len(messages), full, [k for k, (_, through) in turns.items() if full.startswith(through)])]
    rest = [k for k in turns if k not in groups[0][2]]
    while rest:  # the latest turn not yet trained ends the next sample; earlier ones it keeps join it
        last = rest[-1]
        text = turns[last][1]
        members = [k for k in rest if text.startswith(turns[k][1])]
        groups.append((last + 1, text, members))
        rest = [k for k in rest if k not in members]
    samples = []
    for end, text, members in sorted(g for g in groups if g[2]):
        spans = [Turn(k, len(turns[k][0]), len(turns[k][1])) for k in members]
        for a, b in zip(spans, spans[1:]):
            if b.start < a.end:
                raise SkipSample(f"template_not_prefix_stable: turn {b.index} starts before turn {a.index} ends")
        samples.append(Sample(end, text, spans))
    return samples


def _variant_span(tokenizer, messages, tools, turn: Turn, text: str, drop: str) -> str | None:
    """Turn `turn.index` rendered as the last turn without its `drop` field, or None where the
    template then renders what comes before the turn differently."""
    k = turn.index
    changed = {key: value for key, value in messages[k].items() if key != drop}
    through = _render(tokenizer, [*messages[:k], changed], tools, add_generation_prompt=False)
    return through[turn.start:] if through.startswith(text[:turn.start]) else None


def _describe(tokenizer, messages: list[dict], tools, turn: Turn, text: str) -> None:
    """Fill in what the turn's tokens are: how many are its reasoning and its tool calls."""
    message, span, n_tokens = messages[turn.index], text[turn.start:turn.end], turn.n_tokens
    if message.get("tool_calls"):
        without = _variant_span(tokenizer, messages, tools, turn, text, "tool_calls")
        if without == span:
            raise SkipSample("template_ignores_tool_calls: the chat template renders nothing for an "
                             f"assistant message's tool calls (turn {turn.index})")
        if without is None:  # count the calls' own text instead
            without_tokens = n_tokens - len(_encode(tokenizer, "".join(
                c["function"]["name"] + c["function"]["arguments"] for c in message["tool_calls"])))
        else:
            without_tokens = len(_encode(tokenizer, without))
        turn.tool_call_tokens = max(0, n_tokens - without_tokens)
    reasoning = message.get("reasoning_content", "").strip()
    if reasoning:
        turn.reasoning_not_rendered = reasoning not in span
        turn.reasoning_tokens = 0 if turn.reasoning_not_rendered else len(_encode(tokenizer, reasoning))


def tokenize_sample(tokenizer, messages: list[dict], tools, sample: Sample) -> Tokenized:
    """Token ids of the sample's text and a 0/1 mask of its trained turns; fills in each turn's tokens."""
    ids: list[int] = []
    mask: list[int] = []
    cursor = 0
    for turn in sample.turns:
        piece = _encode(tokenizer, sample.text[cursor:turn.start])
        ids += piece
        mask += [0] * len(piece)
        piece = _encode(tokenizer, sample.text[turn.start:turn.end])
        turn.first_token, turn.n_tokens = len(ids), len(piece)
        _describe(tokenizer, messages, tools, turn, sample.text)
        ids += piece
        mask += [1] * len(piece)
        cursor = turn.end
    piece = _encode(tokenizer, sample.text[cursor:])
    ids += piece
    mask += [0] * len(piece)
    return Tokenized(ids, mask, ids == _encode(tokenizer, sample.text))


def tokenize_conversation(tokenizer, messages: list[dict], tools=None) -> Tokenized:
    """The one sample of a conversation whose full rendering keeps every assistant turn."""
    samples = plan_samples(tokenizer, messages, tools)
    if len(samples) != 1:
        raise SkipSample(f"template_not_prefix_stable: the conversation needs {len(samples)} samples")
    return tokenize_sample(tokenizer, messages, tools, samples[0])


def tokenize_shard(tokenizer, conversations_path: str, rows: tuple[int, int], sequence: dict,
                   tokenized_out: str, skipped_out: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The tokenize stage: input rows [start, stop) tokenized; both tables checked, written atomically."""
    start, stop = rows
    kept, skipped = tokenize_records(tokenizer, conversations.read_shard(conversations_path, start, stop),
                                     sequence["max_seq_len"], sequence["min_seq_len"])
    return write_tables(kept, skipped, tokenized_out, skipped_out, f"rows {start}..{stop}")


def write_tables(kept: pd.DataFrame, skipped: pd.DataFrame, tokenized_out: str, skipped_out: str,
                 what: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A tokenized shard's two tables checked against their contracts and written atomically."""
    kept = check(TokenizedShard, kept, tokenized_out)
    skipped = check(SkippedShard, skipped.reset_index(drop=True), skipped_out)
    for path, frame in ((tokenized_out, kept), (skipped_out, skipped)):
        with atomic_path(path) as tmp:
            frame.to_parquet(tmp, index=False)
    logger.info("%s: %d samples, %d skipped %s", what, len(kept), len(skipped),
                skipped["reason"].str.split(":").str[0].value_counts().to_dict())
    return kept, skipped


KEPT_COLUMNS = list(TokenizedShard.to_schema().columns)
SKIPPED_COLUMNS = list(SkippedShard.to_schema().columns)


def tokenize_records(
    tokenizer, rows, max_seq_len: int, min_seq_len: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Tokenize input rows ({source_row, record}); return (kept samples, skipped samples with reasons).

    A conversation gives one skipped row, or one row (kept or skipped) per sample it yields. A sample
    equal to an earlier one of the shard is skipped as a duplicate (pack does the same across shards)."""
    kept, skipped, seen = [], [], set()
    for row in rows:
        record = json.loads(row["record"])
        source = {"source_row": row["source_row"], "source_id": str(record.get("id", ""))}
        try:
            conversation = normalize(record)
            sid = sample_id(conversation.messages, conversation.tools)
        except UnsupportedInput as exc:
            skipped.append({"sample_id": sample_id([{"raw": record}]), **source, "reason": str(exc)})
            continue
        try:
            samples = _conversation_samples(tokenizer, conversation, max_seq_len, min_seq_len)
        except SkipSample as exc:
            skipped.append({"sample_id": sid, **source, "reason": str(exc)})
            continue
        for sample in samples:
            if "reason" in sample:
                skipped.append({**sample, **source})
            elif sample["sample_id"] in seen:
                skipped.append({"sample_id": sample["sample_id"], **source, "reason": DUPLICATE})
            else:
                seen.add(sample["sample_id"])
                kept.append({**sample, **source})
    return pd.DataFrame(kept, columns=KEPT_COLUMNS), pd.DataFrame(skipped, columns=SKIPPED_COLUMNS)


def _conversation_samples(tokenizer, conversation, max_seq_len: int, min_seq_len: int) -> list[dict]:
    """The conversation's samples as table rows: kept ones, or `{sample_id, reason}` for skipped ones."""
    messages, tools = conversation.messages, conversation.tools
    if not messages:
        raise SkipSample("empty_conversation")
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipSample("no_assistant_turn")
    try:
        samples = plan_samples(tokenizer, messages, tools)
        tokenized = [tokenize_sample(tokenizer, messages, tools, s) for s in samples]
    except SkipSample:
        raise
    except Exception as exc:  # a template that raises on this conversation
        raise SkipSample(f"template_error: {type(exc).__name__}: {exc}") from exc
    rows = []
    for part, (sample, tok) in enumerate(zip(samples, tokenized)):
        trained = [t.index for t in sample.turns]
        every_turn = trained == [k for k in range(sample.end) if messages[k]["role"] == "assistant"]
        sid = sample_id(messages[:sample.end], tools, None if every_turn else trained)
        try:
            rows.append({"sample_id": sid, "part": part, **_truncated(sample, tok, max_seq_len, min_seq_len)})
        except SkipSample as exc:
            rows.append({"sample_id": sid, "reason": str(exc)})
    return rows


def _truncated(sample: Sample, tok: Tokenized, max_seq_len: int, min_seq_len: int) -> dict:
    """The sample's columns after truncation to `max_seq_len`, or SkipSample."""
    ids, mask = tok.input_ids, tok.loss_mask
    truncated = len(ids) > max_seq_len
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    if sum(mask) == 0:
        raise SkipSample(
            "no_trainable_tokens_after_truncation" if truncated else "no_trainable_tokens"
        )
    if len(ids) < min_seq_len:
        raise SkipSample(f"shorter_than_min_seq_len: {len(ids)} < {min_seq_len}")
    reasoning = calls = not_rendered = 0
    for turn in sample.turns:
        kept = min(turn.n_tokens, max(0, max_seq_len - turn.first_token))
        # Reasoning comes before the answer and the calls, which come last; truncation cuts the end.
        reasoning += min(turn.reasoning_tokens, kept)
        calls += max(0, turn.tool_call_tokens - (turn.n_tokens - kept))
        not_rendered += turn.reasoning_not_rendered and kept > 0
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "num_tokens": len(ids),
        "num_trainable": sum(mask),
        "truncated": truncated,
        "matches_full_tokenization": tok.matches_full_tokenization,
        "has_tool_calls": calls > 0,
        "has_reasoning": reasoning > 0,
        "reasoning_not_rendered": not_rendered,
        "reasoning_tokens": reasoning,
        "tool_call_tokens": calls,
    }
