"""What a run is about to do, told before it spends GPU hours (`snakemake preflight`).

A Kimi-K2.5 engine takes 20+ minutes to load and a data set takes terabytes, so a wrong capture, a chat
template that drops tool calls, or a disk too small should show in seconds, not after the first shard.
The report reads only the checkpoint's config and tokenizer and a sample of the input: the model and the
captures chosen for it, the chat template, the conversations, shards and tokens, the bytes of states
against the free disk and what each enabled trainer export adds, a time where a measurement supports one
(docs/expectations.md: the same model shape at TP1 on the same kind of machine), and every setting that
differs from the schema's defaults.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from eagle3data.inputs.conversations import count_conversations, read_shard
from eagle3data.contracts.dtypes import ITEMSIZES
from eagle3data.model.weights import reference_layers
from eagle3data.plan.disk import ExportShape, describe_export, export_bytes, sample_bytes
from eagle3data.utils.problems import Problem
from eagle3data.config.settings import Settings, engine_device
from eagle3data.utils.defaults import with_schema_defaults
from eagle3data.engine.start import EngineSettings
from eagle3data.plan import measured
from eagle3data.plan.shards import plan
from eagle3data.inputs.tokenization import load_tokenizer, tokenize_records

SAMPLED_CONVERSATIONS = 256  # the input's first ones are tokenized to estimate its tokens
GIB = 2**30
PROBE = "eagle3probe"  # a word no template writes by itself


def report(config: dict, schema: str | Path) -> tuple[str, list[Problem]]:
    """The preflight report of the run `config` (validated, defaults filled) describes, and the problems
    only the report finds: states larger than the free disk (where storage.check_free_space holds)."""
    settings = Settings(config)
    lines = _model(settings) + _captures(settings) + _parity(settings)
    tokenizer = _tokenizer(config)
    lines += template_support(tokenizer)
    sizes, input_lines = _input(settings, tokenizer)
    disk, problems = _disk(settings, sizes)
    lines += input_lines + disk + _engine(settings.engine) + _time(settings, sizes) + _changed(config, schema)
    return "\n".join(lines), problems


def _model(settings: Settings) -> list[str]:
    info = settings.model
    weights = sum(p.stat().st_size for p in Path(info.path).glob("*.safetensors"))
    return [
        f"model      {info.path}",
        f"           {info.model_type}: {info.num_hidden_layers} layers, hidden {info.hidden_size}, "
        f"vocabulary {info.vocab_size}, {'MLA' if info.uses_mla else 'standard'} attention, "
        f"weights {_size(weights)} ({info.dtype or 'dtype not stated'})",
        f"           states captured in {settings.dtype}; draft vocabulary {settings.draft_vocab_size}",
    ]


def _captures(settings: Settings) -> list[str]:
    n = settings.model.num_hidden_layers
    source = "config" if settings.config["captures"] else f"EAGLE-3's usual four for {n} layers"
    lines = [f"captures   ({source})"]
    for slot, capture in enumerate(settings.captures):
        lines.append(f"           {slot}: {capture.name:<16} {capture.describe(n)} "
                     f"(vLLM aux id {capture.stream_index})")
    return lines


def _parity(settings: Settings) -> list[str]:
    """What the parity gate (validate/parity.py) will hold against the checkpoint, and what it takes."""
    parity = settings.config["parity"]
    if not parity["enabled"]:
        return ["parity     off (parity.enabled: false): no shard is held against the checkpoint"]
    layers, need, first = reference_layers(settings.model.path, [c.stream_index for c in settings.captures],
                                           parity["reference_memory_gib"] * GIB)
    held = sum(c.stream_index <= layers for c in settings.captures)
    reference = (f"in the first {parity['reference_shards']} shards, {held} of {len(settings.captures)} captures "
                 f"against transformers' float32 forward of the first {layers} layers ({_size(need)})"
                 if layers and parity["reference_shards"] else "no transformers reference (parity.reference_shards: 0)"
                 if layers else
                 f"no transformers reference: the first capture's layers take {_size(first)} in float32, "
                 f"parity.reference_memory_gib is {parity['reference_memory_gib']}")
    return [f"parity     {parity['samples_per_shard']} samples a shard: the final capture against the engine's "
            f"next-token log-probabilities; {reference}"]


def _tokenizer(config: dict):
    model = config["model"]
    return load_tokenizer(model["path"], model["trust_remote_code"], model["chat_template_kwargs"])


def template_support(tokenizer) -> list[str]:
    """Whether the chat template writes tool calls and reasoning: a probe conversation rendered."""
    if not tokenizer.chat_template:
        return ["template   none: the tokenizer has no chat template; every conversation will be skipped"]
    tool = {"type": "function", "function": {"name": f"{PROBE}_tool", "parameters": {"type": "object"}}}
    call = {"id": "call_0", "type": "function",
            "function": {"name": f"{PROBE}_call", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok", "reasoning_content": f"{PROBE}_thought",
                 "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False)
    except Exception as exc:  # a template that cannot render tools at all says so here
        return [f"template   found; rendering a tool call fails: {type(exc).__name__}: {exc}"]
    renders = {what: f"{PROBE}_{word}" in text for what, word in
               (("tool declarations", "tool"), ("tool calls", "call"), ("reasoning", "thought"))}
    return ["template   found; renders " + ", ".join(f"{what}: {'yes' if yes else 'NO'}"
                                               for what, yes in renders.items())]


def _input(settings: Settings, tokenizer) -> tuple[dict, list[str]]:
    """Conversations and shards, and tokens and states bytes estimated from the first conversations."""
    config = settings.config
    conversations = count_conversations(config["input"])
    shards = plan(conversations, config["shard_size"])
    sampled = min(conversations, SAMPLED_CONVERSATIONS)
    kept, skipped = tokenize_records(tokenizer, read_shard(config["input"], 0, sampled),
                                     config["sequence"]["max_seq_len"], config["sequence"]["min_seq_len"])
    scale = conversations / max(sampled, 1)
    tokens = kept["num_tokens"].sum() * scale
    states = sum(sample_bytes(int(t), settings.expected) for t in kept["num_tokens"]) * scale
    samples = len(kept) * scale
    reasons = ", ".join(f"{n} {reason}" for reason, n in
                        skipped["reason"].str.split(":").str[0].value_counts().items())
    lines = [
        f"input      {config['input']}: {conversations:,} conversations in {len(shards)} shards of "
        f"up to {config['shard_size']:,}",
        f"           of the first {sampled}: {len(kept)} samples, {kept['num_tokens'].sum():,} tokens "
        f"(max_seq_len {config['sequence']['max_seq_len']}), {len(skipped)} skipped{f' ({reasons})' if reasons else ''}",
        f"           whole input{', estimated' if sampled < conversations else ''}: {tokens:,.0f} tokens",
    ]
    return {"states": states, "tokens": tokens, "samples": samples}, lines


def _exports(settings: Settings, sizes: dict) -> tuple[float, list[str]]:
    """What each enabled export adds to the run (plan.disk's model, the dataset's size estimated from the
    states' raw bytes and the stored ratio measured on real states), and its bytes together."""
    config, lines, total = settings.config, [], 0.0
    compression = config["storage"]["compression"]
    dataset = sizes["states"] * (measured.stored_ratio(precision=compression["precision"])
                                 if compression["codec"] != "none" else 1.0)
    for trainer in ("speculators", "specforge"):
        export = config["export"][trainer]
        if not export["enabled"]:
            continue
        n_states = len(export.get("layer_ids") or []) + 1 if export.get("layer_ids") else len(settings.captures)
        shape = ExportShape(samples=round(sizes["samples"]), tokens=round(sizes["tokens"]), states_per_token=n_states,
                            hidden_size=settings.model.hidden_size, itemsize=ITEMSIZES[settings.dtype])
        linked = (trainer == "speculators" and not config["storage"]["drop_packed_states"]
                  and not export.get("layer_ids"))
        total += export_bytes(trainer, export["states"], shape, linked)
        lines.append(f"export     {describe_export(trainer, export['states'], shape, round(dataset), linked)}"
                     .replace("disk: the ", ""))
    return total, lines


def _disk(settings: Settings, sizes: dict) -> tuple[list[str], list[Problem]]:
    storage = settings.config["storage"]
    copies = 1 if storage["drop_packed_states"] else 2
    exports, export_lines = _exports(settings, sizes)
    needed = sizes["states"] * copies + exports + storage["reserve_gib"] * GIB
    where = settings.run_dir
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    verdict = "enough" if free >= needed else "NOT ENOUGH"
    why = "the packed dataset" if copies == 1 else "the store and the packed dataset (storage.drop_packed_states: false)"
    problems = [] if free >= needed or not storage["check_free_space"] else [Problem(
        "storage", f"the states need about {_size(needed)} (reserve_gib {storage['reserve_gib']} included); "
        f"{_size(free)} is free at {where.resolve()}.", "a disk with room for the states",
        "free space, put results/ on a larger disk, or set storage.check_free_space: false to start anyway.")]
    return [
        f"states     {_size(sizes['states'])} estimated; {copies} cop{'y' if copies == 1 else 'ies'} "
        f"on disk: {why}",
        *export_lines,
        f"disk       {_size(free)} free at {where.resolve()}, {_size(needed)} needed with "
        f"{'the exports and ' if export_lines else ''}reserve_gib {storage['reserve_gib']}: {verdict}",
    ], problems


def _engine(engine: EngineSettings) -> list[str]:
    line = f"engine     {engine.device}, tensor parallel {engine.tensor_parallel_size}"
    if engine.device == "cuda":
        import torch

        line += f"; {torch.cuda.device_count()} GPUs visible here"
    return [line]


def _time(settings: Settings, sizes: dict) -> list[str]:
    """A time to the packed dataset where a measured run supports it (plan.measured.measured_rate: the same
    model shape at TP1 on the same kind of machine), else why there is none."""
    engine = settings.engine
    device = "cpu"
    if engine.device == "cuda":
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU visible"
    shape = json.loads((Path(settings.model.path) / "config.json").read_text())
    shape = shape.get("text_config", shape)
    rate = measured.measured_rate(device, shape, engine.tensor_parallel_size,
                               settings.config["storage"]["compression"]["codec"])
    if rate is None:
        return [f"time       not estimated: nothing measured supports it for this model (hidden "
                f"{shape.get('hidden_size')}, {shape.get('num_hidden_layers')} layers) at tensor parallel "
                f"{engine.tensor_parallel_size} on {device} (measured: docs/expectations.md; "
                "python -m eagle3bench.projection models a node)"]
    seconds = sizes["tokens"] / rate.dataset_tps + rate.fixed_seconds
    return [f"time       about {_duration(seconds)} to the packed dataset: {sizes['tokens']:,.0f} tokens at "
            f"{rate.dataset_tps:,.0f} tok/s + {rate.fixed_seconds:,.0f} s of fixed costs, as measured for "
            f"{rate.model['name']} on {rate.hardware} ({rate.file}; docs/expectations.md)"
            + (f"; this machine has {os.cpu_count()} cores" if device == "cpu" else "")]


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 5400 else f"{seconds / 60:,.0f} min" if seconds >= 90 \
        else f"{seconds:,.0f} s"


def _changed(config: dict, schema: str | Path) -> list[str]:
    """Every setting that differs from the schema's default (run, input and model.path aside)."""
    defaults = with_schema_defaults({"input": config["input"], "model": {"path": config["model"]["path"]}},
                                    schema)
    defaults["engine"]["device"] = engine_device(defaults["engine"]["device"])  # as rules/common.smk does
    changed = [f"           {key}: {json.dumps(value)} (default {json.dumps(default)})"
               for key, value, default in _leaves(config, defaults) if key not in ("run", "input")]
    return ["settings   differing from the defaults:" if changed else "settings   all defaults"] + changed


def _size(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"


def _leaves(config: dict, defaults: dict, prefix: str = ""):
    for key, value in config.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            yield from _leaves(value, default, f"{prefix}{key}.")
        elif value != default:
            yield f"{prefix}{key}", value, default
