"""Reading conversations: counting them cheaply, slicing a shard, normalizing records, stable ids.

A shard is a contiguous range of input rows, so appending conversations to the input adds shards
without reshuffling existing ones. Sample ids hash the normalized conversation, so they do not depend
on file layout and a re-run finds its earlier results.

Every input form becomes the OpenAI message list that Hugging Face chat templates render:
`{role, content}` with `content` a string, plus `tool_calls: [{type: function, function: {name,
arguments}}]` (and `id` where the data has one) and `reasoning_content` on assistant messages,
`tool_call_id`/`name` on tool messages where known. Policies (the README's "Input formats"):
- text parts of a content list are concatenated with nothing between them (OpenAI's and the
  Qwen/Kimi templates' way); a part's payload is its `text` (OpenAI) or `value` (LLaMA-Factory's
  `{type, value}` parts); a part of any other kind (image, audio, file...) is refused with its type;
- reasoning (`reasoning_content`, `reasoning`, `thinking`, or parts of type reasoning/thinking) is
  kept as `reasoning_content`, message field first, then parts, concatenated;
- call arguments are passed as a JSON string, as OpenAI's API gives them (a string is kept verbatim,
  an object is serialized with `json.dumps(ensure_ascii=False)`: what `tojson` writes);
- a ShareGPT `function_call` turn's value is `{"name", "arguments"}` (or a list of them) as JSON; it
  becomes the tool calls of an assistant message, joining the assistant message right before it
  (text then calls, or parallel calls) or opening a new one with empty content. ShareGPT calls have
  no ids; none are invented;
- a `tool_call` part (LLaMA-Factory's form) holds the same JSON as a ShareGPT function_call turn and is
  read by the same code; its calls join the message's own `tool_calls`, after its text (the order the
  templates, and LLaMA-Factory's renderers, write them in). A `tool_response`/`observation` part becomes
  a tool message of its own, one per part; only a tool or user message that holds nothing else may
  carry them;
- a ShareGPT record's non-empty top-level `system` field (LLaMA-Factory's layout) is its system message,
  unless the turns begin with one;
- a tool result gets the `name` (and `tool_call_id`) of the call it answers, matched by id, else by
  position among the results that follow the calling message.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "tool_response": "tool",
    "tool_result": "tool",
    "function_response": "tool",
    "ipython": "tool",
    "function_call": "tool_call",
    "function_calls": "tool_call",
    "tool_call": "tool_call",
    "tool_calls": "tool_call",
}
OPENAI_ROLES = {"system": "system", "developer": "developer", "user": "user", "assistant": "assistant",
                "tool": "tool", "function": "tool"}
TEXT_PARTS = {"text", "input_text", "output_text"}
REASONING_PARTS = {"reasoning", "thinking"}
TOOL_CALL_PARTS = {"tool_call", "tool_calls", "function_call"}
TOOL_RESULT_PARTS = {"tool_response", "tool_result", "observation", "function_response"}
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


class UnsupportedInput(ValueError):
    """A record that cannot become a conversation; the message is the recorded skip reason."""


@dataclass
class Conversation:
    messages: list[dict]
    tools: list[dict] | None


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


@dataclass
class _Content:
    """What a message's content holds: text, reasoning, tool calls and tool results (from parts)."""

    text: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)  # {content, tool_call_id?, name?} per result part


def _part_value(part: dict, kind: str | None):
    """A part's payload: under `text` or its type's name (OpenAI), or under `value` (LLaMA-Factory); the
    first non-empty one, else an empty one, else None."""
    values = [part[key] for key in ("text", kind, "value") if key is not None and part.get(key) is not None]
    return next((v for v in values if v != ""), values[0] if values else None)


def _content(content) -> _Content:
    """A message's content: a string, one part or a list of parts."""
    if content is None:
        return _Content()
    if isinstance(content, str):
        return _Content(content)
    parts = [content] if isinstance(content, dict) else content
    if not isinstance(parts, list):
        raise UnsupportedInput(f"non_text_content:{type(content).__name__}")
    out, text, reasoning = _Content(), [], []
    for part in parts:
        if isinstance(part, str):
            text.append(part)
            continue
        if not isinstance(part, dict):
            raise UnsupportedInput(f"non_text_content:{type(part).__name__}")
        kind = part.get("type", "text" if "text" in part else None)
        value = _part_value(part, kind)
        if kind in TEXT_PARTS:
            text.append("" if value is None else str(value))
        elif kind in REASONING_PARTS:
            reasoning.append("" if value is None else str(value))
        elif kind in TOOL_CALL_PARTS:
            out.calls.extend(_json_calls(value, f"{kind} part value"))
        elif kind in TOOL_RESULT_PARTS:
            if value is None:
                raise UnsupportedInput(f"bad_tool_response: {kind} part without a value")
            result = {"content": value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}
            result.update({k: part[k] for k in ("tool_call_id", "name") if part.get(k)})
            out.results.append(result)
        else:
            raise UnsupportedInput(f"non_text_content:{kind}")
    out.text, out.reasoning = "".join(text), "".join(reasoning)
    return out


def _reasoning(turn: dict, from_parts: str) -> str:
    fields = [turn[k] for k in REASONING_FIELDS if isinstance(turn.get(k), str)]
    return "".join(fields[:1]) + from_parts


def _tool_call(call) -> dict:
    """One call in OpenAI form; accepts the nested form and the flat `{name, arguments}` one."""
    if not isinstance(call, dict):
        raise UnsupportedInput(f"bad_tool_call: a call is a {type(call).__name__}, not an object")
    if call.get("type", "function") != "function":
        raise UnsupportedInput(f"bad_tool_call: type {call.get('type')!r} is not 'function'")
    function = call["function"] if isinstance(call.get("function"), dict) else call
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise UnsupportedInput("bad_tool_call: a call without a function name")
    arguments = function.get("arguments", function.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call.get("id"):
        out["id"] = str(call["id"])
    return out


def _json_calls(value, source: str = "function_call value") -> list[dict]:
    """A ShareGPT function_call turn's value, or a `tool_call` part's: a JSON object `{name, arguments}`
    or a list of them (or that object or list already parsed). `source` names it in skip reasons."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise UnsupportedInput(f"bad_tool_call: {source} is not JSON ({exc.msg})") from exc
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise UnsupportedInput(f"bad_tool_call: {source} holds no call")
    return [_tool_call(c) for c in calls]


def normalize_tools(tools) -> list[dict] | None:
    """The `tools` field (a list, or that list as a JSON string) in OpenAI form, or None."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise UnsupportedInput(f"bad_tools: the tools string is not JSON ({exc.msg})") from exc
    tools = [tools] if isinstance(tools, dict) else tools
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UnsupportedInput("bad_tools: tools must be a list of objects")
    out = []
    for tool in tools:
        if "type" in tool:
            out.append(tool)
        elif isinstance(tool.get("name"), str):  # a bare function schema, as ShareGPT tool data writes it
            out.append({"type": "function", "function": tool})
        else:
            raise UnsupportedInput("bad_tools: a tool without a type or a function name")
    return out or None


class _Builder:
    """Appends turns as OpenAI messages, linking each tool result to the call it answers."""

    def __init__(self):
        self.messages: list[dict] = []
        self.calls: list[dict] = []  # the calls of the last assistant message
        self.answered = 0  # tool results since that message

    def add(self, role: str, text: str, reasoning: str = "", calls: list[dict] | None = None,
            extra: dict | None = None) -> None:
        if reasoning and role != "assistant":
            raise UnsupportedInput(f"reasoning_on_non_assistant_turn:{role}")
        if role == "tool_call":
            if text or reasoning:
                raise UnsupportedInput("bad_tool_call: function_call turn with text besides the call")
            last = self.messages[-1] if self.messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).extend(calls)
            else:
                self.messages.append({"role": "assistant", "content": "", "tool_calls": calls})
                self.answered = 0
            self.calls = self.messages[-1]["tool_calls"]
            return
        message = {"role": role, "content": text}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            message.update(self._answered_call(extra or {}))
        if role == "assistant":
            self.calls, self.answered = calls or [], 0
        self.messages.append(message)

    def _answered_call(self, extra: dict) -> dict:
        by_id = {c.get("id"): c for c in self.calls if c.get("id")}
        call = by_id.get(extra.get("tool_call_id"))
        if call is None and self.answered < len(self.calls):
            call = self.calls[self.answered]
        self.answered += 1
        link = {}
        call_id = extra.get("tool_call_id") or (call or {}).get("id")
        if call_id:
            link["tool_call_id"] = str(call_id)
        name = extra.get("name") or (call or {}).get("function", {}).get("name")
        if name:
            link["name"] = str(name)
        return link


def _add_turn(built: _Builder, role: str, content: _Content, reasoning: str, calls: list[dict],
              extra: dict) -> None:
    """One input message: the message itself, or the tool messages of its tool result parts."""
    calls = calls + content.calls
    if calls and role != "assistant":
        raise UnsupportedInput(f"bad_tool_call: tool calls on a {role} message")
    if not content.results:
        built.add(role, content.text, reasoning, calls, extra)
        return
    if role not in ("tool", "user"):
        raise UnsupportedInput(f"bad_tool_response: tool results in a message of role {role}")
    if content.text or reasoning:
        raise UnsupportedInput(f"bad_tool_response: a {role} message holds text besides its tool results")
    for result in content.results:
        # The message's own tool_call_id/name can only say which call a lone result answers.
        link = extra if len(content.results) == 1 else {}
        built.add("tool", result["content"], "", None,
                  {k: result.get(k) or link.get(k) for k in ("tool_call_id", "name")})


def _openai(turns: list) -> list[dict]:
    built = _Builder()
    for turn in turns:
        if not isinstance(turn, dict):
            raise UnsupportedInput(f"bad_message: a message is a {type(turn).__name__}")
        role = OPENAI_ROLES.get(turn.get("role"))
        if role is None:
            raise UnsupportedInput(f"unknown_role:{turn.get('role')}")
        content = _content(turn.get("content"))
        calls = turn.get("tool_calls") or ([turn["function_call"]] if turn.get("function_call") else [])
        if not isinstance(calls, list):
            raise UnsupportedInput("bad_tool_call: tool_calls is not a list")
        _add_turn(built, role, content, _reasoning(turn, content.reasoning), [_tool_call(c) for c in calls],
                  {"tool_call_id": turn.get("tool_call_id"), "name": turn.get("name")})
    return built.messages


def _sharegpt(turns: list) -> list[dict]:
    built = _Builder()
    for turn in turns:
        if not isinstance(turn, dict):
            raise UnsupportedInput(f"bad_message: a turn is a {type(turn).__name__}")
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise UnsupportedInput(f"unknown_role:{turn.get('from')}")
        if role == "tool_call":
            built.add(role, "", "", _json_calls(turn.get("value")))
            continue
        content = _content(turn.get("value"))
        _add_turn(built, role, content, _reasoning(turn, content.reasoning), [], {"name": turn.get("name")})
    return built.messages


def normalize(record: dict) -> Conversation:
    """ShareGPT (`conversations: [{from, value}]`) or OpenAI (`messages: [{role, content}]`) form, with
    an optional `tools` field, as OpenAI messages and tools. Raises UnsupportedInput with the reason."""
    if isinstance(record.get("messages"), list):
        messages = _openai(record["messages"])
    elif isinstance(record.get("conversations"), list):
        messages = _sharegpt(record["conversations"])
        system = record.get("system")
        if isinstance(system, str) and system and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": system})
    else:
        raise UnsupportedInput("no_conversation_field")
    return Conversation(messages, normalize_tools(record.get("tools")))


def normalize_messages(record: dict) -> list[dict]:
    """The messages of `normalize(record)`."""
    return normalize(record).messages


def sample_id(messages: list[dict], tools: list | None = None, turns: list[int] | None = None) -> str:
    """Stable id of a sample: a hash of its normalized conversation and, when the sample trains only
    some of the conversation's assistant turns, of which."""
    content = {"messages": messages, "tools": tools}
    if turns is not None:
        content["turns"] = turns
    blob = json.dumps(content, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]
