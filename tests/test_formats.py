"""The conversation formats real EAGLE-3 data comes in, through the tokenize stage (no engine needed).

The files under data/formats/ (ShareGPT, OpenAI and LLaMA-Factory tool use, content parts, reasoning,
duplicates) are
tokenized with templates written here that reproduce how real templates treat tools and reasoning:
Qwen3's (reasoning dropped before the last user message) and Kimi-K2's (history turns get an empty
`<think></think>`). Each kept sample's trained tokens are compared, token by token, with each assistant
turn written out by hand from the template's layout; the untrained tokens must hold the user text and
the tool results; every assistant turn must be trained exactly once.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from eagle3data.inputs.conversations import UnsupportedInput, normalize, read_shard
from eagle3data.model.demo import KIMI_STYLE_CHAT_TEMPLATE, build_demo_tokenizer
from eagle3data.inputs.tokenization import tokenize_records, tokenize_shard

from conftest import DEMO_CONVERSATIONS, REPO, demo_config, run_snakemake

FORMATS = REPO / "data" / "formats"

QWEN3_STYLE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KIMI_STYLE = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_user|>user<|im_middle|>"
    "{% elif m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
    "{% else %}<|im_system|>{{ m.role }}<|im_middle|>{% endif %}"
    "{% if m.role == 'assistant' %}<think>{% if loop.index0 > ns.last_user %}{{ m.reasoning_content or '' }}"
    "{% endif %}</think>{% endif %}"
    "{{ m.content }}"
    "{% if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>"
    "functions.{{ c.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>{{ c.function.arguments }}"
    "<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}"
    "<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
RAISES_ON_TOOLS = (
    "{% if tools %}{{ raise_exception('This template does not support tools.') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_turn(m: dict) -> str:
    """An assistant turn as QWEN3_STYLE writes it when the turn is the last (reasoning kept)."""
    think = f"<think>\n{m['reasoning_content']}\n</think>\n\n" if m.get("reasoning_content") else ""
    calls = "".join(f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}'
                    "\n</tool_call>" for c in m.get("tool_calls", []))
    return f"{think}{m['content']}{calls}<|im_end|>\n"


def kimi_turn(m: dict) -> str:
    """An assistant turn as KIMI_STYLE writes it when the turn is the last (reasoning kept)."""
    calls = "".join(f"<|tool_call_begin|>functions.{c['function']['name']}:{i}<|tool_call_argument_begin|>"
                    f"{c['function']['arguments']}<|tool_call_end|>" for i, c in enumerate(m.get("tool_calls", [])))
    section = f"<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>" if calls else ""
    return f"<think>{m.get('reasoning_content', '')}</think>{m['content']}{section}<|im_end|>"


TEMPLATES = {"qwen3": (QWEN3_STYLE, qwen3_turn), "kimi": (KIMI_STYLE, kimi_turn)}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The demo's byte-level BPE tokenizer (Kimi's markers as special tokens), trained on these files."""
    texts = [line for path in sorted(FORMATS.glob("*.jsonl")) for line in path.read_text().splitlines()]
    tok = build_demo_tokenizer(texts, tmp_path_factory.mktemp("formats-tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|tool_calls_section_begin|>",
                                                          "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                                          "<|tool_call_argument_begin|>", "<|tool_call_end|>"]},
                           replace_extra_special_tokens=False)
    return tok


def tokenize_file(tok, template: str, name: str, max_seq_len: int = 4096):
    tok.chat_template = template
    path = FORMATS / name
    n = sum(1 for line in path.open() if line.strip())
    kept, skipped = tokenize_records(tok, read_shard(path, 0, n), max_seq_len=max_seq_len, min_seq_len=1)
    records = {i: json.loads(line) for i, line in enumerate(path.read_text().splitlines())}
    return kept, skipped, records


def runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The maximal runs of trainable token ids, in order."""
    out, current = [], None
    for token, m in zip(ids, mask):
        if m and current is None:
            current = []
            out.append(current)
        if m:
            current.append(token)
        else:
            current = None
    return out


def check_masks(tok, template_name: str, kept: pd.DataFrame, records: dict) -> dict[int, list[list[int]]]:
    """Every kept sample's mask, token by token; returns {source_row: trained turns per sample}."""
    template, turn_text = TEMPLATES[template_name]
    trained = {}
    for row in kept.sort_values(["source_row", "part"]).itertuples():
        messages = normalize(records[row.source_row]).messages
        tools = normalize(records[row.source_row]).tools
        ids, mask = list(row.input_ids), list(row.loss_mask)
        turns = []
        for run in runs(ids, mask):
            matching = [k for k, m in enumerate(messages) if m["role"] == "assistant"
                        and tok.encode(turn_text(m), add_special_tokens=False) == run]
            assert matching, f"row {row.source_row} part {row.part}: trained run {tok.decode(run)!r} is no turn"
            turns.append(matching[0])
        assert turns == sorted(turns)
        # The sample is the conversation up to its last trained turn, rendered as the template does.
        end = turns[-1] + 1
        rendered = tok.apply_chat_template(messages[:end], tools=tools, tokenize=False)
        assert tok.decode(ids) == rendered
        # So the trained tokens are exactly those turns; everything else (user text, tool results,
        # system prompt and tools, earlier turns trained in other samples) is context.
        context = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert all(m["content"] in context for m in messages[:end] if m["role"] in ("user", "tool", "system"))
        calls = [messages[k] for k in turns if messages[k].get("tool_calls")]
        reasoning = [messages[k]["reasoning_content"] for k in turns if messages[k].get("reasoning_content")]
        assert row.has_tool_calls == bool(calls)
        assert row.has_reasoning == bool(reasoning)
        assert row.reasoning_tokens == sum(len(tok.encode(r, add_special_tokens=False)) for r in reasoning)
        # What the calls add to their turns, as the hand-written layout writes them with and without.
        length = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
        assert row.tool_call_tokens == sum(
            length(turn_text(m)) - length(turn_text({k: v for k, v in m.items() if k != "tool_calls"}))
            for m in calls)
        assert row.reasoning_not_rendered == 0
        trained.setdefault(row.source_row, []).append(turns)
    for source_row, parts in trained.items():  # every assistant turn trained exactly once
        messages = normalize(records[source_row]).messages
        assert sorted(k for turns in parts for k in turns) == [
            k for k, m in enumerate(messages) if m["role"] == "assistant"]
    return trained


def reasons(skipped: pd.DataFrame, records: dict) -> dict[str, str]:
    return {records[r]["id"]: reason for r, reason in zip(skipped["source_row"], skipped["reason"])}


# ---------------------------------------------------------------------------------------------------
# Normalization: what each form becomes
# ---------------------------------------------------------------------------------------------------


def test_sharegpt_function_call_turns_become_assistant_tool_calls():
    records = [json.loads(line) for line in (FORMATS / "sharegpt_tools.jsonl").read_text().splitlines()]
    conversation = normalize(records[1])
    assert conversation.tools == [{"type": "function", "function": json.loads(records[1]["tools"])[0]}]
    call = lambda value, unit, to: {"type": "function", "function": {  # noqa: E731
        "name": "convert_units", "arguments": json.dumps({"value": value, "from": unit, "to": to})}}
    assert conversation.messages == [
        {"role": "system", "content": "You convert units precisely."},
        {"role": "user", "content": "How many kilometres is a marathon in miles, and 5 kg in pounds?"},
        # The text turn and the parallel calls after it are one assistant message.
        {"role": "assistant", "content": "Let me convert both.",
         "tool_calls": [call(26.2, "mi", "km"), call(5, "kg", "lb")]},
        {"role": "tool", "content": "42.16", "name": "convert_units"},
        {"role": "tool", "content": "11.02", "name": "convert_units"},
        {"role": "assistant", "content": "A marathon is 42.16 km, and 5 kg is 11.02 lb."},
    ]
    # A top-level system field is the system message; arguments already a string stay verbatim.
    first, third = normalize(records[0]).messages, normalize(records[2]).messages
    assert first[0] == {"role": "system", "content": "You are a weather assistant. Use the tools."}
    assert first[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]}
    assert third[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert third[2] == {"role": "tool", "content": "snow, -4 C", "name": "get_weather"}


def test_openai_tool_results_are_linked_to_their_calls_by_id():
    records = [json.loads(line) for line in (FORMATS / "openai_tools.jsonl").read_text().splitlines()]
    messages = normalize(records[1]).messages
    assert messages[3] == {"role": "tool", "content": "no such book", "tool_call_id": "r2", "name": "reserve_book"}
    assert messages[4] == {"role": "tool", "content": "reserved", "tool_call_id": "r1", "name": "reserve_book"}
    # Object arguments become the JSON string OpenAI's API would give; the legacy function_call too.
    assert normalize(records[0]).messages[3]["tool_calls"][0] == {
        "type": "function", "id": "call_a2", "function": {"name": "reserve_book", "arguments": '{"book_id": "b17"}'}}
    legacy = normalize(records[2]).messages
    assert legacy[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "search_books", "arguments": '{"query": "octopus"}'}}]
    assert legacy[2] == {"role": "tool", "content": "[]", "name": "search_books"}
    assert normalize(records[1]).tools == records[0]["tools"]  # the JSON-string tools equal the list


def test_text_parts_are_concatenated_and_reasoning_parts_become_reasoning_content():
    records = [json.loads(line) for line in (FORMATS / "openai_parts_reasoning.jsonl").read_text().splitlines()]
    assert normalize(records[0]).messages == [
        {"role": "user", "content": "Summarize: cats sleep a lot."},
        {"role": "assistant", "content": "Cats nap most of the day."}]
    messages = normalize(records[2]).messages
    assert [m.get("reasoning_content") for m in messages[1::2]] == [
        "12 * 12 = 144.", "sqrt(144) = 12, doubled is 24.", "A short acknowledgement fits."]
    assert [m["content"] for m in messages[1::2]] == ["144.", "24.", "You're welcome!"]


def test_llamafactory_parts_become_tool_calls_tool_messages_text_and_reasoning():
    records = [json.loads(line) for line in (FORMATS / "llamafactory_tools.jsonl").read_text().splitlines()]
    call = lambda name, **args: {"type": "function", "function": {  # noqa: E731
        "name": name, "arguments": json.dumps(args)}}
    first = normalize(records[0])
    assert first.tools == [{"type": "function", "function": json.loads(records[0]["tools"])[0]}]
    assert first.messages == [
        {"role": "system", "content": "You help travellers with Belgian rail timetables."},
        {"role": "user", "content": "Is there a train from Ghent to Bruges after 18:00 today?"},
        # A text part and a tool_call part of one message: its content and its call.
        {"role": "assistant", "content": "Let me check this evening's departures.",
         "tool_calls": [call("find_trains", origin="Ghent", destination="Bruges", after="18:00")]},
        {"role": "tool", "content": '[{"departs": "18:12", "arrives": "18:37"}, {"departs": "18:42", "arrives": '
                                    '"19:07"}]', "name": "find_trains"},
        {"role": "assistant", "content": "Yes: one leaves at 18:12 (in Bruges at 18:37) and another at 18:42 "
                                         "(at 19:07)."}]
    # Two tool_call parts are two calls; the two tool_response parts of one message, two tool messages.
    assert normalize(records[1]).messages[1:4] == [
        {"role": "assistant", "content": "", "tool_calls": [
            call("ticket_price", origin="Ghent", destination="Bruges", travel_class=2),
            call("ticket_price", origin="Ghent", destination="Ostend", travel_class=2)]},
        {"role": "tool", "content": '{"eur": 8.1}', "name": "ticket_price"},
        {"role": "tool", "content": '{"eur": 11.4}', "name": "ticket_price"}]
    # One tool_call part holding a list of calls, beside a reasoning part.
    third = normalize(records[2]).messages
    assert third[1] == {"role": "assistant", "content": "",
                        "reasoning_content": "Two independent lookups, so I can ask for both at once.",
                        "tool_calls": [call("find_trains", origin="Ghent", destination="Antwerp", after="07:00"),
                                       call("find_trains", origin="Ghent", destination="Brussels", after="07:00")]}
    assert third[4]["reasoning_content"] == "07:04 is before 07:09, though Brussels arrives first."
    assert third[4]["content"].startswith("The Antwerp train leaves first")


def test_tool_result_parts_stand_alone_in_a_tool_or_user_message():
    ask = {"role": "user", "content": "Price to Ostend?"}
    calls = {"role": "assistant", "content": [
        {"type": "tool_call", "value": '{"name": "ticket_price", "arguments": {"to": "Ostend"}}'}]}

    def messages(*after):
        return normalize({"messages": [ask, calls, *after]}).messages

    result = {"type": "tool_response", "value": {"eur": 11.4}}
    # A user message of results only (templates that wrap results in a user turn) gives tool messages.
    assert messages({"role": "user", "content": [result]})[2] == {
        "role": "tool", "content": '{"eur": 11.4}', "name": "ticket_price"}
    for message, reason in [
            ({"role": "assistant", "content": [result]},
             "bad_tool_response: tool results in a message of role assistant"),
            ({"role": "tool", "content": [{"type": "text", "value": "Ostend:"}, result]},
             "bad_tool_response: a tool message holds text besides its tool results"),
            ({"role": "tool", "content": [{"type": "observation"}]},
             "bad_tool_response: observation part without a value"),
            ({"role": "user", "content": calls["content"]}, "bad_tool_call: tool calls on a user message")]:
        with pytest.raises(UnsupportedInput) as raised:
            messages(message)
        assert str(raised.value) == reason


# ---------------------------------------------------------------------------------------------------
# Masks, token by token, through the tokenize stage
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["qwen3", "kimi"])
def test_sharegpt_tools_masks_and_skips(tokenizer, template):
    kept, skipped, records = tokenize_file(tokenizer, TEMPLATES[template][0], "sharegpt_tools.jsonl")
    trained = check_masks(tokenizer, template, kept, records)
    assert {records[r]["id"] for r in trained} == {"sg-tools-0", "sg-tools-1", "sg-tools-2"}
    assert all(len(parts) == 1 for parts in trained.values())  # no reasoning: one sample each
    found = reasons(skipped, records)
    assert found["sg-tools-3"].startswith("bad_tool_call: function_call value is not JSON")
    assert found["sg-tools-4"].startswith("bad_tools: the tools string is not JSON")
    assert len(found) == 2 and len(kept) + len(skipped) == len(records)
    assert kept["has_tool_calls"].sum() == 3


@pytest.mark.parametrize("template", ["qwen3", "kimi"])
def test_openai_tools_masks_and_skips(tokenizer, template):
    kept, skipped, records = tokenize_file(tokenizer, TEMPLATES[template][0], "openai_tools.jsonl")
    trained = check_masks(tokenizer, template, kept, records)
    assert [records[r]["id"] for r in sorted(trained)] == ["oa-tools-0", "oa-tools-1", "oa-tools-2"]
    assert trained[0] == [[1, 3, 5]]  # the calls, the text before a call and the answer, all trained
    found = reasons(skipped, records)
    assert found == {"oa-tools-3": "bad_tool_call: a call without a function name",
                     "oa-tools-4": "bad_tools: a tool without a type or a function name"}


@pytest.mark.parametrize("template", ["qwen3", "kimi"])
def test_llamafactory_tools_masks_and_skips(tokenizer, template):
    kept, skipped, records = tokenize_file(tokenizer, TEMPLATES[template][0], "llamafactory_tools.jsonl")
    trained = check_masks(tokenizer, template, kept, records)
    assert {records[r]["id"]: parts for r, parts in trained.items()} == {
        "lf-tools-0": [[2, 4]], "lf-tools-1": [[1, 4]], "lf-tools-2": [[1, 4]]}
    # The template writes every call out, inside the trained tokens.
    marker = {"qwen3": "<tool_call>", "kimi": "<|tool_call_begin|>"}[template]
    for row in kept.itertuples():
        calls = [c for m in normalize(records[row.source_row]).messages for c in m.get("tool_calls", [])]
        trained_text = tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])
        assert trained_text.count(marker) == len(calls) == {0: 1, 1: 2, 2: 2}[row.source_row]
        assert all(c["function"]["arguments"] in trained_text for c in calls)
    assert kept["has_tool_calls"].all() and (kept["tool_call_tokens"] > 0).all()
    assert reasons(skipped, records) == {
        "lf-tools-3": "bad_tool_call: tool_call part value is not JSON (Expecting value)",
        "lf-tools-4": "bad_tool_call: a call without a function name"}
    assert len(kept) + len(skipped) == len(records) == 5


def test_reasoning_qwen3_style_splits_where_history_loses_its_reasoning(tokenizer):
    kept, skipped, records = tokenize_file(tokenizer, QWEN3_STYLE, "openai_parts_reasoning.jsonl")
    trained = check_masks(tokenizer, "qwen3", kept, records)
    ids = {records[r]["id"]: parts for r, parts in trained.items()}
    assert ids["parts-0"] == [[1]] and ids["reason-0"] == [[1]]
    # Three user turns: each answer keeps its reasoning only while it is the last; one sample each.
    assert ids["reason-1"] == [[1], [3], [5]]
    # The call and the answer after the tool result share the last user turn: one sample for both.
    assert ids["reason-tools-0"] == [[1, 3], [5]]
    assert reasons(skipped, records) == {"image-0": "non_text_content:image_url",
                                        "audio-0": "non_text_content:input_audio"}
    split = kept.groupby("source_row")["part"].agg(list)
    assert all(parts == list(range(len(parts))) for parts in split)
    assert kept["sample_id"].is_unique and len(kept) == 7


def test_reasoning_kimi_style_history_turns_get_empty_think(tokenizer):
    kept, skipped, records = tokenize_file(tokenizer, KIMI_STYLE, "openai_parts_reasoning.jsonl")
    ids = {records[r]["id"]: parts for r, parts in check_masks(tokenizer, "kimi", kept, records).items()}
    assert ids["reason-1"] == [[1], [3], [5]] and ids["reason-tools-0"] == [[1, 3], [5]]
    # The last sample of reason-1 shows the history as the template writes it: empty thinking.
    last = kept[(kept["source_row"] == 2) & (kept["part"] == 2)].iloc[0]
    assert tokenizer.decode(last["input_ids"]).count("<think></think>") == 2
    assert kept["has_reasoning"].sum() == 6  # every sample but parts-0's


def test_report_rows_say_what_the_samples_train(tokenizer):
    from eagle3data.report.pages import content_rows

    kept, _, _ = tokenize_file(tokenizer, QWEN3_STYLE, "openai_parts_reasoning.jsonl")
    rows = dict(content_rows(kept))
    trainable = int(kept["num_trainable"].sum())
    reasoning, calls = int(kept["reasoning_tokens"].sum()), int(kept["tool_call_tokens"].sum())
    assert 0 < reasoning and 0 < calls and reasoning + calls < trainable
    assert rows["samples training reasoning"] == "6 (85.7%)"
    assert rows["samples training tool calls"] == "1 (14.3%)"
    assert rows["trainable tokens: reasoning"] == f"{reasoning} ({reasoning / trainable:.1%})"
    assert rows["trainable tokens: answers and turn markers"].startswith(f"{trainable - reasoning - calls} (")


def test_truncation_keeps_the_facts_of_the_tokens_left(tokenizer):
    from eagle3data.contracts.schemas import TokenizedShard, check

    full, _, records = tokenize_file(tokenizer, QWEN3_STYLE, "openai_parts_reasoning.jsonl")
    row = full[(full["source_row"] == 5) & (full["part"] == 0)].iloc[0]  # trains the call turn and the answer
    mask = list(row["loss_mask"])
    call_turn, answer = runs(list(range(len(mask))), mask)  # the positions of the two trained turns
    messages = normalize(records[5]).messages
    first_reasoning = len(tokenizer.encode(messages[1]["reasoning_content"], add_special_tokens=False))
    assert row["reasoning_tokens"] > first_reasoning and row["has_tool_calls"]
    for max_seq_len, reasoning, calls in [(answer[0], first_reasoning, row["tool_call_tokens"]),
                                          (call_turn[0] + 2, 2, 0)]:
        kept, _, _ = tokenize_file(tokenizer, QWEN3_STYLE, "openai_parts_reasoning.jsonl", max_seq_len)
        cut = check(TokenizedShard, kept, "truncated")
        cut = cut[(cut["source_row"] == 5) & (cut["part"] == 0)].iloc[0]
        assert cut["truncated"] and (cut["reasoning_tokens"], cut["tool_call_tokens"]) == (reasoning, calls)
        assert cut["has_tool_calls"] == (calls > 0)


def test_a_template_without_reasoning_keeps_the_answer_and_counts_the_reasoning_it_drops(tokenizer):
    kept, _, records = tokenize_file(tokenizer, KIMI_STYLE_CHAT_TEMPLATE, "openai_parts_reasoning.jsonl")
    rows = {records[r]["id"]: row for r, row in zip(kept["source_row"], kept.itertuples())}
    assert rows["reason-1"].reasoning_not_rendered == 3 and not rows["reason-1"].has_reasoning
    assert rows["reason-0"].reasoning_not_rendered == 1 and rows["reason-0"].reasoning_tokens == 0
    trainable = tokenizer.decode([t for t, m in zip(rows["reason-0"].input_ids, rows["reason-0"].loss_mask) if m])
    assert trainable == "No: 91 is 7 × 13.<|im_end|>"


def test_templates_that_cannot_render_tools_give_skips_with_the_reason(tokenizer):
    _, skipped, records = tokenize_file(tokenizer, KIMI_STYLE_CHAT_TEMPLATE, "sharegpt_tools.jsonl")
    found = reasons(skipped, records)
    assert found["sg-tools-0"] == "template_ignores_tools: the chat template renders nothing for the tools list"
    _, skipped, records = tokenize_file(tokenizer, RAISES_ON_TOOLS, "openai_tools.jsonl")
    found = reasons(skipped, records)
    assert found["oa-tools-0"] == "template_error: TemplateError: This template does not support tools."
    # Calls without a tools list, under a template that prints only content: the calls would vanish.
    tokenizer.chat_template = KIMI_STYLE_CHAT_TEMPLATE
    call = {"type": "function", "function": {"name": "search_books", "arguments": "{}"}}
    record = {"messages": [{"role": "user", "content": "Find tides."},
                           {"role": "assistant", "content": "", "tool_calls": [call]}]}
    kept, skipped = tokenize_records(tokenizer, [{"source_row": 0, "record": json.dumps(record)}], 4096, 1)
    assert kept.empty and skipped["reason"].iloc[0].startswith("template_ignores_tool_calls:")


# ---------------------------------------------------------------------------------------------------
# Duplicates, and the stage's files
# ---------------------------------------------------------------------------------------------------


def test_duplicates_in_one_shard_are_recorded_skips(tokenizer, tmp_path):
    tokenizer.chat_template = QWEN3_STYLE
    path = FORMATS / "duplicates.jsonl"
    out, skipped_out = tmp_path / "shard.parquet", tmp_path / "shard.skipped.parquet"
    kept, skipped = tokenize_shard(tokenizer, str(path), (0, 6), {"max_seq_len": 512, "min_seq_len": 1},
                                   str(out), str(skipped_out))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [records[r]["id"] for r in kept["source_row"]] == ["dup-0", "dup-2", "dup-3"]
    # ShareGPT and OpenAI forms of one conversation, and text parts that join to the same text, are equal.
    assert {records[r]["id"]: reason for r, reason in zip(skipped["source_row"], skipped["reason"])} == {
        "dup-1": "duplicate_conversation", "dup-4": "duplicate_conversation", "dup-5": "duplicate_conversation"}
    assert set(skipped["sample_id"]) <= set(kept["sample_id"])
    assert pd.read_parquet(out)["sample_id"].tolist() == kept["sample_id"].tolist()
    assert len(pd.read_parquet(skipped_out)) == 3


def test_split_conversations_reconcile_at_pack():
    from eagle3data.dataset.index import _reconcile
    from eagle3data.dataset.pack import _split_samples

    kept = pd.DataFrame({"source_row": [0, 0, 0, 1], "sample_id": list("abcd")})  # row 0: three samples
    skipped = pd.DataFrame({"sample_id": ["e", "f"], "source_row": [1, 2], "source_id": ["", ""],
                            "reason": ["shorter_than_min_seq_len: 3 < 8", "non_text_content:image_url"]})
    split = _split_samples([kept, kept.iloc[:0], skipped])
    assert split == 3  # rows 0 and 1 give two samples beyond their first
    counts = _reconcile(3, split, 4, [skipped])
    assert counts["split_samples"] == 3 and counts["skip_reasons"] == {"shorter_than_min_seq_len": 1,
                                                                      "non_text_content": 1}
    with pytest.raises(Exception, match="do not reconcile"):
        _reconcile(3, 0, 4, [skipped])


def test_snakemake_tokenizes_every_format_file_without_a_failed_job(tiny_deepseek, tmp_path):
    """A real run of the tokenize rule with the demo model's tokenizer and template, every file at once
    (the run checks the whole checkpoint before its first job)."""
    rows = [line for path in sorted(FORMATS.glob("*.jsonl")) for line in path.read_text().splitlines()]
    data = tmp_path / "formats.jsonl"
    data.write_text("\n".join(rows) + "\n")
    config = demo_config(input=str(data), run="formats", shard_size=8)
    config["model"].update(path=str(tiny_deepseek), build_demo=False)
    shards = [f"results/formats/tokenized/shard-{i:05d}.parquet" for i in range((len(rows) + 7) // 8)]
    # A flag between the config file and the targets: --configfile would take the targets as files.
    run_snakemake(tmp_path, "--printshellcmds", *shards, config=config, timeout=600)
    kept = pd.concat(pd.read_parquet(tmp_path / s) for s in shards)
    skipped = pd.concat(pd.read_parquet(tmp_path / s.replace(".parquet", ".skipped.parquet")) for s in shards)
    assert set(kept["source_row"]) | set(skipped["source_row"]) == set(range(len(rows)))
    assert len(kept) + len(skipped) == len(rows)  # the demo template rewrites no turn: nothing splits
    # The demo template renders neither tools nor calls: tool data is skipped, with the reason.
    assert skipped["reason"].str.split(":").str[0].value_counts().to_dict() == {
        "template_ignores_tools": 10, "duplicate_conversation": 3, "bad_tool_call": 4, "bad_tools": 2,
        "non_text_content": 2}
    assert kept["reasoning_not_rendered"].sum() == 4 and not kept["has_reasoning"].any()
