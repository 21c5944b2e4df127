"""A generated response as the OpenAI assistant message a client would get back from vLLM's server.

The tokenize stage renders messages with the target's chat template, and a template renders reasoning
(`reasoning_content`) and tool calls (`tool_calls`) in its own layout. So the raw text is split the way
vLLM's OpenAI server splits it: by vLLM's reasoning parser and tool parser for the model when the config
names them (`regenerate.reasoning_parser`, `regenerate.tool_parser`), else reasoning at the template's
think markers (`regenerate.think_markers`) and no tool-call parsing. What the template then renders is
what the target sees at serving time, when a client sends the conversation back.
"""

from __future__ import annotations

from typing import Any

RANDOM_ID_PREFIX = "chatcmpl-tool-"  # vLLM's random tool-call ids (other parsers make stable ones)


class ReplyParser:
    """Turns generated text into `{role: assistant, content, reasoning_content?, tool_calls?}`."""

    def __init__(self, tokenizer, reasoning_parser: str | None, tool_parser: str | None,
                 think_markers: tuple[str, str]):
        self.tokenizer = tokenizer
        self.think_markers = think_markers
        self.reasoning = _reasoning_parser(reasoning_parser)(tokenizer) if reasoning_parser else None
        self.tool_parser_cls = _tool_parser(tool_parser) if tool_parser else None

    def parse(self, text: str, tools: list | None, key: str) -> dict:
        """`key` names the response: tool-call ids that vLLM draws at random are derived from it instead,
        so parsing the same text again gives the same message (and the same sample id)."""
        request = _chat_request(tools) if self.reasoning or self.tool_parser_cls else None
        if self.reasoning is not None:
            extract = getattr(self.reasoning, "extract_reasoning", None) or self.reasoning.extract_reasoning_content
            reasoning, content = extract(text, request)
        else:
            reasoning, content = split_at_markers(text, *self.think_markers)
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tool_parser_cls is not None and tools:
            info = self._tool_parser(tools).extract_tool_calls(content or "", request)
            if info.tools_called:
                message["content"] = info.content or ""
                message["tool_calls"] = [_stable_id(call.model_dump(exclude_none=True), key, i)
                                         for i, call in enumerate(info.tool_calls)]
        return message

    def _tool_parser(self, tools: list):
        try:  # vLLM 0.32 hands the request's tools to the parser; older ones take the tokenizer only
            return self.tool_parser_cls(self.tokenizer, tools=_chat_request(tools).tools)
        except TypeError:
            return self.tool_parser_cls(self.tokenizer)


def _stable_id(call: dict, key: str, index: int) -> dict:
    if str(call.get("id", "")).startswith(RANDOM_ID_PREFIX):
        call["id"] = f"{RANDOM_ID_PREFIX}{key[:16]}-{index}"
    return call


def split_at_markers(text: str, start: str, end: str) -> tuple[str | None, str]:
    """(reasoning, content): the text before `end` is reasoning (a leading `start` removed; templates
    often put `start` in the generation prompt), the rest is content. Without `end`, a text that opens
    with `start` was cut while thinking: all reasoning; any other text is all content."""
    head, found, tail = text.partition(end)
    if found:
        head = head.lstrip()
        return (head[len(start):] if head.startswith(start) else head).strip("\n"), tail.lstrip("\n")
    if text.lstrip().startswith(start):
        return text.lstrip()[len(start):].strip("\n"), ""
    return None, text


def _reasoning_parser(name: str):
    from vllm.reasoning import ReasoningParserManager

    return ReasoningParserManager.get_reasoning_parser(name)


def _tool_parser(name: str):
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager
    return ToolParserManager.get_tool_parser(name)


def _chat_request(tools: list | None):
    """The request object vLLM's parsers read (they look at its tools and sampling flags only)."""
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    return ChatCompletionRequest(model="target", messages=[], tools=tools or None)
