"""The regenerate stage on a real trained target (SmolLM2-135M-Instruct) in real vLLM on CPU.

One workflow run, SIGKILLed right after its third response is stored, then resumed to the end: the
resumed job reuses exactly those three and generates the rest; tokenize, extract, validate and pack
follow, and the counts reconcile with the rows that regeneration dropped. The stored answers are the
model's own: greedy decoding by transformers from the same prompts gives the same text, turn by turn
(the second turn of a conversation conditioned on the first regenerated one). The journal and the reply
parsing (vLLM's own parsers) are checked directly, without an engine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pandas as pd
import pytest
import yaml

from conftest import REPO, SNAKEMAKE, run_snakemake
from eagle3data.engine.start import EngineSettings
from eagle3data.regenerate.journal import Journal, JournalError
from eagle3data.regenerate.stage import RegenerateJob, RegenerateSettings, Regenerator, plan
from eagle3data.utils import faults

RUN = "regen"
MAX_NEW_TOKENS = 32
ROWS = [
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"},
                                   {"role": "assistant", "content": "Paris."}]},
    {"id": "story", "conversations": [{"from": "human", "value": "Write a long story about a dog."},
                                      {"from": "gpt", "value": "Once there was a dog."}]},
    {"id": "two-turns", "messages": [{"role": "system", "content": "You answer in one short sentence."},
                                     {"role": "user", "content": "What is 2 + 2?"},
                                     {"role": "assistant", "content": "Four."},
                                     {"role": "user", "content": "And 3 + 3?"},
                                     {"role": "assistant", "content": "Six."}]},
    {"id": "unanswered", "messages": [{"role": "user", "content": "Name a fruit that is yellow."}]},
    {"id": "no-conversation", "text": "Not a conversation: passed through, and tokenize skips it."},
    {"id": "sky", "conversations": [{"from": "human", "value": "What color is the sky on a clear day?"},
                                    {"from": "gpt", "value": "Blue."}]},
]
TURNS = 6  # capital, story, two-turns x2, unanswered, sky


def config(model, conversations) -> dict:
    return {
        "run": RUN, "input": str(conversations), "shard_size": 8,
        "model": {"path": str(model), "build_demo": False, "dtype": "float32", "hidden_size": 576,
                  "num_hidden_layers": 30},
        "captures": [{"layer": 2, "point": "input"}, {"layer": 15, "point": "input"},
                     {"layer": 27, "point": "input"}, {"layer": 29, "point": "output"}],
        "sequence": {"max_seq_len": 256, "min_seq_len": 8},
        "draft_vocab_size": 256,
        "engine": {"device": "cpu", "max_num_batched_tokens": 1024, "cpu_kv_cache_gib": 1},
        "regenerate": {"enabled": True, "turns": "all", "max_new_tokens": MAX_NEW_TOKENS, "truncated": "drop"},
    }


def run_killed_at(workdir, point: str) -> None:
    """The workflow in a session of its own (the fault kills the whole process group), SIGKILLed at
    `point`; then --unlock, which a killed snakemake needs."""
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
           "--configfile", str(workdir / "test-config.yaml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=workdir,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", faults.ENV: f"kill@{point}"}, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {point}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    run_snakemake(workdir, "--unlock")


@pytest.fixture(scope="module")
def resumed(smollm2, tmp_path_factory):
    """(workdir, journal bytes right after the kill): killed after 3 stored responses, then run to the end."""
    workdir = tmp_path_factory.mktemp("regenerate")
    conversations = workdir / "conversations.jsonl"
    conversations.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (workdir / "test-config.yaml").write_text(yaml.safe_dump(config(smollm2, conversations)))
    run_killed_at(workdir, "regenerate:stored#3")
    journal = workdir / "results" / RUN / "regenerated" / "journal" / "shard-00000.jsonl"
    after_kill = journal.read_bytes()
    run_snakemake(workdir)
    return workdir, after_kill


@pytest.mark.slow
def test_killed_job_generates_only_what_was_missing(resumed):
    workdir, after_kill = resumed
    regenerated = workdir / "results" / RUN / "regenerated"
    assert after_kill.count(b"\n") == 3
    journal = (regenerated / "journal" / "shard-00000.jsonl").read_bytes()
    assert journal.startswith(after_kill) and journal.count(b"\n") == TURNS  # nothing generated twice
    stats = json.loads((regenerated / "shard-00000.stats.json").read_text())
    assert (stats["turns_reused"], stats["turns_generated"]) == (3, TURNS - 3)
    log = (workdir / "results" / RUN / "logs" / "regenerate" / "shard-00000.log").read_text()
    assert f"6 conversations, 3 turns reused from results/{RUN}/regenerated/journal/shard-00000.jsonl" in log
    turns = pd.read_parquet(regenerated / "shard-00000.responses.parquet")
    assert sorted(turns["origin"]) == ["generated"] * (TURNS - 3) + ["reused"] * 3


@pytest.mark.slow
def test_regenerated_run_tokenizes_extracts_validates_and_packs(resumed):
    workdir, _ = resumed
    results = workdir / "results" / RUN
    stats = json.loads((results / "regenerated" / "shard-00000.stats.json").read_text())
    turns = pd.read_parquet(results / "regenerated" / "shard-00000.responses.parquet")
    cut = sorted(turns.loc[turns["finish_reason"] == "length", "source_row"])
    # The story is cut at 32 new tokens (others may be too); cut conversations are dropped with the reason.
    assert 1 in cut and len(cut) < TURNS and set(turns["finish_reason"]) == {"stop", "length"}
    assert stats["finish_reasons"] == {"stop": TURNS - len(cut), "length": len(cut)}
    assert sorted(r["source_row"] for r in stats["skipped_rows"]) == cut
    assert {r["reason"].split(":")[0] for r in stats["skipped_rows"]} == {"regenerate_truncated"}
    assert (stats["regenerated"], stats["original"], stats["skipped"]) == (len(ROWS) - 1 - len(cut), 1, len(cut))
    counts = json.loads((results / "dataset.counts.json").read_text())
    assert counts["conversations_in"] == len(ROWS) == counts["packed"] + counts["skipped"]
    assert counts["skip_reasons"] == {"regenerate_truncated": len(cut), "no_conversation_field": 1}
    tokenized = pd.read_parquet(results / "tokenized" / "shard-00000.parquet")
    kept = [i for i in range(len(ROWS)) if i not in cut and ROWS[i]["id"] != "no-conversation"]
    assert sorted(tokenized["source_row"]) == kept  # the input's row numbers
    assert sorted(tokenized["source_id"]) == sorted(ROWS[i]["id"] for i in kept)
    assert (results / "dataset").is_dir() and (results / "report" / "regenerate.html").exists()


@pytest.mark.slow
def test_regenerated_answers_equal_transformers_greedy(resumed, smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workdir, _ = resumed
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    lines = (workdir / "results" / RUN / "regenerated" / "shard-00000.jsonl").read_text().splitlines()
    compared = 0
    for doc in map(json.loads, lines):
        messages = doc["record"].get("messages", [])  # a row passed through may have none
        for k, message in enumerate(messages):
            if message["role"] != "assistant" or k == 0:
                continue
            prompt = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
            out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)[0, ids.shape[1]:].tolist()
            if out[-1] == tokenizer.eos_token_id:
                out = out[:-1]
            assert message["content"] == tokenizer.decode(out), (doc["record"]["id"], k)
            compared += 1
    assert compared >= 3  # capital, both turns of two-turns, ... (those not cut and dropped)


def test_journal_drops_a_torn_last_line_and_refuses_damage(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    for key in "ab":
        journal.append({"key": key, "text": f"answer {key}"})
    journal.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"crc": "0000')  # a kill in the middle of the next line
    journal = Journal(path)
    assert sorted(journal.entries) == ["a", "b"] and path.read_bytes() == whole
    journal.append({"key": "c", "text": "answer c"})
    journal.close()
    assert sorted(Journal(path).entries) == ["a", "b", "c"]
    path.write_bytes(whole.replace(b"answer a", b"answer x") + b"\n")
    with pytest.raises(JournalError, match="line 1 is damaged"):
        Journal(path)


def test_replies_split_by_vllms_parsers_and_at_think_markers(smollm2):
    from transformers import AutoTokenizer

    from eagle3data.regenerate.replies import ReplyParser

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    text = ('<think>\nThe user wants weather.\n</think>\n\nLet me look. '
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    for reasoning_parser in ("qwen3", None):  # vLLM's parser, then the think markers
        parser = ReplyParser(tokenizer, reasoning_parser, "hermes", ("<think>", "</think>"))
        message = parser.parse(text, tools, key="0123456789abcdef0123")
        assert message["reasoning_content"].strip() == "The user wants weather."
        assert message["content"].strip() == "Let me look."
        (call,) = message["tool_calls"]
        assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
        assert message == parser.parse(text, tools, key="0123456789abcdef0123")  # stable call ids
    plain = ReplyParser(tokenizer, None, None, ("<think>", "</think>")).parse("Just text.", tools, key="k")
    assert plain == {"role": "assistant", "content": "Just text."}


def test_turns_past_the_model_length_end_the_conversation_or_fail_it(smollm2, tmp_path):
    """turns: all. A later turn whose prompt fills the model length ends the conversation there (tokenize
    would cut it there); a first turn that does not fit is an error (prompt_too_long), journaled."""
    from transformers import AutoTokenizer

    settings = RegenerateSettings.with_defaults({"enabled": True, "turns": "all"})
    job = RegenerateJob(conversations="-", rows=(0, 1), out="-", responses="-", stats="-", journal="-",
                        model_path=str(smollm2), trust_remote_code=False, dtype="float32", max_seq_len=56,
                        engine=EngineSettings.with_defaults({"load_format": "auto"}), settings=settings)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    regen = Regenerator(job, tokenizer, Journal(tmp_path / "journal.jsonl"), max_model_len=64)
    conv = plan(0, ROWS[2], "all", tokenizer)  # system, user, assistant, user, assistant
    first = regen.next_request(conv)
    assert first is not None and len(first.prompt_ids) < 64
    regen.finish(conv, {"key": first.key, "text": "Four. " * 20, "num_tokens": 40, "finish_reason": "stop",
                        "error": None})
    assert regen.next_request(conv) is None and conv.stop is None
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user"]
    assert conv.messages[2]["content"] == "Four. " * 20 and len(regen.turns) == 1

    long_question = {"messages": [{"role": "user", "content": "why " * 80}]}
    conv = plan(1, long_question, "all", tokenizer)
    assert regen.next_request(conv) is None and conv.stop.startswith("regenerate_error: turn 0: prompt_too_long")
    assert regen.turns[-1]["finish_reason"] == "error" and len(regen.journal.entries) == 2
