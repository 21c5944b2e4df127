"""Reading conversations: counting them cheaply, slicing a shard, normalizing roles, stable ids.

A shard is a contiguous range of input rows, so appending conversations to the input adds shards
without reshuffling existing ones. Sample ids hash the normalized conversation, so they do not depend
on file layout and a re-run finds its earlier results.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pyarrow.parquet as pq

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
OPENAI_ROLES = {"system", "developer", "user", "assistant", "tool"}


class UnsupportedInput(ValueError):
    pass


def _suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in {".jsonl", ".json", ".parquet"}:
        raise UnsupportedInput(f"{path}: expected a .jsonl, .json or .parquet file, got {suffix!r}")
    return suffix


def count_conversations(path: str | Path) -> int:
    """Number of input rows, without parsing them where the format allows (planning must be fast)."""
    path = Path(path)
    suffix = _suffix(path)
    if suffix == ".parquet":
        return pq.ParquetFile(path).metadata.num_rows
    if suffix == ".json":
        return len(json.loads(path.read_text()))
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def read_shard(path: str | Path, start: int, stop: int):
    """Rows [start, stop) of the input as a `datasets.Dataset` (plus their row numbers)."""
    import datasets  # here, not above: the Snakefile imports this module to plan, and datasets costs seconds

    path = Path(path)
    suffix = _suffix(path)
    if suffix == ".parquet":
        table = pq.read_table(path).slice(start, stop - start)
        rows = table.to_pylist()
    elif suffix == ".json":
        rows = json.loads(path.read_text())[start:stop]
    else:
        with open(path, "rb") as f:
            lines = (line for line in f if line.strip())
            rows = [json.loads(line) for line in itertools.islice(lines, start, stop)]
    # Keep each record as a JSON string: conversations in one file may mix forms and fields, which
    # Arrow schema inference would widen or reject.
    return datasets.Dataset.from_dict(
        {"source_row": list(range(start, start + len(rows))), "record": [json.dumps(r) for r in rows]}
    )


def normalize_messages(record: dict) -> list[dict]:
    """ShareGPT (`conversations: [{from, value}]`) or OpenAI (`messages: [{role, content}]`) form,
    as a list of `{role, content}` with OpenAI role names. Raises UnsupportedInput with the reason."""
    if isinstance(record.get("messages"), list):
        messages = []
        for turn in record["messages"]:
            role = turn.get("role")
            if role not in OPENAI_ROLES:
                raise UnsupportedInput(f"unknown_role:{role}")
            content = turn.get("content")
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise UnsupportedInput("non_text_content")
            message = {"role": role, "content": content}
            if turn.get("tool_calls"):
                message["tool_calls"] = turn["tool_calls"]
            messages.append(message)
        return messages
    if isinstance(record.get("conversations"), list):
        messages = []
        for turn in record["conversations"]:
            role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
            if role is None:
                raise UnsupportedInput(f"unknown_role:{turn.get('from')}")
            messages.append({"role": role, "content": turn.get("value") or ""})
        return messages
    raise UnsupportedInput("no_conversation_field")


def sample_id(messages: list[dict], tools: list | None = None) -> str:
    """Stable id of a conversation: a hash of its normalized content."""
    blob = json.dumps({"messages": messages, "tools": tools}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]
