"""Assistant-only loss masks, checked token by token for several chat templates.

Each expectation is built by hand from the template's known layout (which pieces are the assistant's),
independently of the prefix-diffing the pipeline uses.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eagle3data.inputs.conversations import normalize_messages, sample_id
from eagle3data.inputs.tokenization import SkipSample, tokenize_conversation, tokenize_records

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about rivers."},
    {"role": "assistant", "content": "Rivers carry water to the sea."},
    {"role": "user", "content": "And glaciers?"},
    {"role": "assistant", "content": "Glaciers flow like slow rivers of ice."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_deepseek):
    tok = AutoTokenizer.from_pretrained(tiny_deepseek)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def pieces_to_expected(tok, pieces):
    ids, mask = [], []
    for text, trainable in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        ids += piece
        mask += [int(trainable)] * len(piece)
    return ids, mask


def check(tok, template, pieces):
    tok.chat_template = template
    result = tokenize_conversation(tok, CONVERSATION)
    want_ids, want_mask = pieces_to_expected(tok, pieces)
    assert result.input_ids == want_ids
    assert result.loss_mask == want_mask
    assert result.matches_full_tokenization


def test_chatml_mask(tokenizer):
    c = CONVERSATION
    check(tokenizer, CHATML, [
        (f"<|im_start|>system\n{c[0]['content']}<|im_end|>\n<|im_start|>user\n{c[1]['content']}"
         "<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{c[2]['content']}<|im_end|>\n", True),
        (f"<|im_start|>user\n{c[3]['content']}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{c[4]['content']}<|im_end|>\n", True),
    ])


def test_llama3_mask(tokenizer):
    c = CONVERSATION
    h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
    check(tokenizer, LLAMA3, [
        (f"[BOS]{h('system')}{c[0]['content']}<|eot_id|>{h('user')}{c[1]['content']}<|eot_id|>"
         f"{h('assistant')}", False),
        (f"{c[2]['content']}<|eot_id|>", True),
        (f"{h('user')}{c[3]['content']}<|eot_id|>{h('assistant')}", False),
        (f"{c[4]['content']}<|eot_id|>", True),
    ])


def test_kimi_style_mask_with_system_and_several_turns(tokenizer):
    from eagle3data.model.demo import KIMI_STYLE_CHAT_TEMPLATE

    c = CONVERSATION
    a = "<|im_assistant|>assistant<|im_middle|>"
    check(tokenizer, KIMI_STYLE_CHAT_TEMPLATE, [
        (f"<|im_system|>system<|im_middle|>{c[0]['content']}<|im_end|>"
         f"<|im_user|>user<|im_middle|>{c[1]['content']}<|im_end|>{a}", False),
        (f"{c[2]['content']}<|im_end|>", True),
        (f"<|im_user|>user<|im_middle|>{c[3]['content']}<|im_end|>{a}", False),
        (f"{c[4]['content']}<|im_end|>", True),
    ])


def test_template_that_rewrites_earlier_turns_gives_one_sample_per_kept_turn(tokenizer):
    # Drops earlier assistant turns' content once a later turn exists (like thinking-stripping templates):
    # each turn is trained where it is the last, the rewritten one is context in the later sample.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' and not loop.last %}"
        "...{% else %}{{ m['content'] }}{% endif %};{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(SkipSample, match="template_not_prefix_stable: the conversation needs 2 samples"):
        tokenize_conversation(tokenizer, CONVERSATION)
    rows = [{"source_row": 7, "record": json.dumps({"messages": CONVERSATION})}]
    kept, skipped = tokenize_records(tokenizer, rows, max_seq_len=512, min_seq_len=1)
    assert skipped.empty and kept["part"].tolist() == [0, 1] and kept["source_row"].tolist() == [7, 7]
    c = CONVERSATION
    for row, (context, trained) in zip(kept.itertuples(), [
        (f"system:{c[0]['content']};user:{c[1]['content']};assistant:", f"{c[2]['content']};"),
        (f"system:{c[0]['content']};user:{c[1]['content']};assistant:...;user:{c[3]['content']};assistant:",
         f"{c[4]['content']};"),
    ]):
        want_ids, want_mask = pieces_to_expected(tokenizer, [(context, False), (trained, True)])
        assert list(row.input_ids) == want_ids and list(row.loss_mask) == want_mask
    assert kept["sample_id"].is_unique


def test_template_whose_generation_prompt_differs_from_its_turns_is_skipped_with_reason(tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
        "{% if add_generation_prompt %}bot:{% endif %}"
    )
    with pytest.raises(SkipSample, match="template_not_prefix_stable: the generation prompt before turn 2"):
        tokenize_conversation(tokenizer, CONVERSATION)


def test_sharegpt_and_openai_forms_give_the_same_sample():
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    openai = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert normalize_messages(sharegpt) == normalize_messages(openai)
    assert sample_id(normalize_messages(sharegpt)) == sample_id(normalize_messages(openai))


def test_skips_are_recorded_with_reasons(tokenizer):
    tokenizer.chat_template = CHATML
    rows = [
        {"source_row": 0, "record": json.dumps({"messages": [{"role": "user", "content": "q?"}]})},
        {"source_row": 1, "record": json.dumps({"text": "no conversation here"})},
        {"source_row": 2, "record": json.dumps({"conversations": [{"from": "alien", "value": "x"}]})},
        {"source_row": 3, "record": json.dumps({"messages": CONVERSATION})},
        {"source_row": 4, "record": json.dumps({"messages": [
            {"role": "user", "content": "rivers and glaciers " * 40},
            {"role": "assistant", "content": "ok"}]})},
    ]
    kept, skipped = tokenize_records(tokenizer, rows, max_seq_len=60, min_seq_len=4)
    reasons = dict(zip(skipped["source_row"], skipped["reason"]))
    assert reasons[0] == "no_assistant_turn"
    assert reasons[1] == "no_conversation_field"
    assert reasons[2] == "unknown_role:alien"
    # Row 4's only assistant turn starts after token 60: nothing trainable survives truncation.
    assert reasons[4] == "no_trainable_tokens_after_truncation"
    assert list(kept["source_row"]) == [3] and kept["num_tokens"].iloc[0] == 60
    assert len(kept) + len(skipped) == len(rows)


def test_template_kwargs_reach_every_rendering(tokenizer):
    """`model.chat_template_kwargs` (a thinking switch here) shapes the rendered sample and its mask, as
    it shapes regenerate's prompts: without it the sample is what the target renders by default."""
    from eagle3data.inputs.tokenization import with_template_kwargs

    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and thinking %}<think></think>{% endif %}{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.chat_template = template
    plain = tokenize_conversation(tokenizer, CONVERSATION)
    thinking = tokenize_conversation(with_template_kwargs(tokenizer, {"thinking": True}), CONVERSATION)
    del tokenizer.apply_chat_template  # the fixture is shared: back to the class's method
    trained = tokenizer.decode([i for i, m in zip(thinking.input_ids, thinking.loss_mask) if m])
    assert trained.count("<think></think>") == 2 and "<think>" not in tokenizer.decode(plain.input_ids)
    assert sum(thinking.loss_mask) > sum(plain.loss_mask)
