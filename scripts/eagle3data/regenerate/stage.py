"""The `regenerate` stage: the target model writes each conversation's assistant turns anew.

A draft learns to predict what the target says next; trained on another model's answers it learns the
wrong distribution (and never sees a thinking model's reasoning). So, before tokenize, the target writes
the assistant turns itself: the last one only, or every one in order, each conditioned on its own
earlier answers (`regenerate.turns`). Prompts are the conversation so far rendered by the target's chat
template with the generation prompt (`model.chat_template_kwargs`, e.g. enable_thinking), tokenized
as vLLM's server does: what the target sees at serving time.

The engine is the extraction engine's settings without capture (`engine.engine_kwargs`). Requests go to
vLLM's engine loop one by one and each response is appended to the shard's journal (journal.py) the
moment it finishes, keyed by a hash of its prompt tokens and every setting that shapes it, so a killed
job resumes with only the missing responses. Each turn's finish reason is recorded: an error, or a
response cut at `max_new_tokens` (with `truncated: drop`), ends that conversation's generation and it is
skipped with the reason, unless `keep_original_on_failure` keeps the original on an error. Counts
reconcile: conversations in = regenerated + kept original + skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass, field

import pandas as pd
from tqdm import tqdm

from eagle3data.engine import start as engine_mod
from eagle3data.inputs.conversations import UnsupportedInput, normalize, read_shard, sample_id
from eagle3data.regenerate.journal import Journal
from eagle3data.utils.defaults import Section
from eagle3data.utils.logs import get_logger
from eagle3data.model.info import read_model_info
from eagle3data.regenerate.replies import ReplyParser
from eagle3data.storage.store import atomic_path, atomic_write_text
from eagle3data.utils import faults
from eagle3data.inputs.tokenization import with_template_kwargs

logger = get_logger(__name__)

# A regenerated record's fields that its normalized `messages` and `tools` replace (ShareGPT's included).
REPLACED_FIELDS = ("conversations", "messages", "system", "tools")
RESPONSE_COLUMNS = ["source_row", "turn", "message_index", "finish_reason", "tokens_before", "tokens_after",
                    "origin", "error"]


@dataclass(frozen=True)
class RegenerateSettings(Section):
    """The config's `regenerate` section, typed."""

    NAME = "regenerate"

    enabled: bool
    turns: str
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    reasoning_parser: str | None
    think_markers: list[str]
    tool_parser: str | None
    truncated: str
    keep_original_on_failure: bool


@dataclass
class RegenerateJob:
    conversations: str  # the input file; rows [start, stop) are this shard
    rows: tuple[int, int]
    out: str  # regenerated conversations, JSON lines {source_row, record}
    responses: str  # one row per generated turn (parquet)
    stats: str
    journal: str
    model_path: str
    trust_remote_code: bool
    dtype: str
    max_seq_len: int
    engine: engine_mod.EngineSettings
    settings: RegenerateSettings
    chat_template_kwargs: dict = field(default_factory=dict)  # config `model.chat_template_kwargs`


@dataclass
class Rewrite:
    """One input row on its way through regeneration."""

    source_row: int
    record: dict
    messages: list[dict] = field(default_factory=list)  # generated turns replace the originals as they come
    tools: list | None = None
    positions: list[int] = field(default_factory=list)  # message indices to write, in order
    tokens_before: list[int | None] = field(default_factory=list)  # the original's length per position
    pass_reason: str | None = None  # why it passes through unchanged (nothing to regenerate)
    stop: str | None = None  # why its generation ended early (error, truncated)
    done: int = 0


@dataclass
class Request:
    key: str
    prompt_ids: list[int]
    max_tokens: int


def plan(source_row: int, record: dict, turns: str, tokenizer) -> Rewrite:
    """What to generate for one input row: the assistant turns, or an answer to a final user/tool turn."""
    conv = Rewrite(source_row, record)
    try:
        normalized = normalize(record)
    except UnsupportedInput as exc:
        conv.pass_reason = str(exc)
        return conv
    messages, conv.tools = normalized.messages, normalized.tools
    positions = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]  # with a prompt
    if messages and messages[-1]["role"] in ("user", "tool"):
        positions.append(len(messages))
    if not positions:
        conv.pass_reason = "no_turn_to_generate"
        return conv
    conv.positions = positions[-1:] if turns == "last" else positions
    conv.messages = messages[: conv.positions[-1] + 1]
    conv.tokens_before = [_length(tokenizer, messages[p]) if p < len(messages) else None for p in conv.positions]
    return conv


def _length(tokenizer, message: dict) -> int:
    text = (message.get("reasoning_content") or "") + (message.get("content") or "")
    return len(tokenizer.encode(text, add_special_tokens=False))


class Regenerator:
    """Walks conversations turn by turn: turns found in the journal are applied, the first missing one
    becomes a request; finished responses are stored, then applied."""

    def __init__(self, job: RegenerateJob, tokenizer, journal: Journal, max_model_len: int):
        self.settings, self.tokenizer, self.journal = job.settings, tokenizer, journal
        self.max_model_len = max_model_len
        self.parser = ReplyParser(tokenizer, job.settings.reasoning_parser, job.settings.tool_parser,
                                  tuple(job.settings.think_markers))
        self.shape = dict(  # everything besides the prompt that shapes a response
            model=read_model_info(job.model_path).identity, dtype=job.dtype,
            # random weights answer otherwise; every other loader loads the same weights
            load_format="dummy" if job.engine.load_format == "dummy" else "auto", max_model_len=max_model_len,
            **{k: getattr(job.settings, k) for k in ("temperature", "top_p", "seed", "max_new_tokens")},
        )
        self.turns: list[dict] = []

    def prompt_ids(self, messages: list[dict], tools) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def next_request(self, conv: Rewrite) -> Request | None:
        while conv.stop is None and conv.done < len(conv.positions):
            try:
                ids = self.prompt_ids(conv.messages[: conv.positions[conv.done]], conv.tools)
            except Exception as exc:  # a template that raises on this conversation: nothing to store
                self.apply(conv, error_entry("", f"template_error: {type(exc).__name__}: {exc}"), "generated")
                continue
            blob = json.dumps({"prompt": ids, **self.shape}, sort_keys=True).encode()
            key = hashlib.sha256(blob).hexdigest()
            if key in self.journal.entries:
                self.apply(conv, self.journal.entries[key], "reused")
                continue
            max_tokens = min(self.settings.max_new_tokens, self.max_model_len - len(ids))
            if max_tokens < 1 and conv.done > 0:  # earlier turns fill the model length: tokenize would
                conv.messages = conv.messages[: conv.positions[conv.done]]  # cut the conversation here
                del conv.positions[conv.done:], conv.tokens_before[conv.done:]
                continue
            if max_tokens < 1:
                self.finish(conv, error_entry(key, f"prompt_too_long: {len(ids)} tokens leave no room to "
                                                   f"generate within {self.max_model_len}"))
                continue
            return Request(key, ids, max_tokens)
        return None

    def sampling_params(self, request: Request):
        from vllm import SamplingParams

        # Per-request seeds: a response does not depend on what else is in the batch, or on a resume.
        # Special tokens stay in the text: think and tool-call markers are special in some vocabularies.
        return SamplingParams(temperature=self.settings.temperature, top_p=self.settings.top_p,
                              seed=int(request.key[:8], 16), max_tokens=request.max_tokens,
                              skip_special_tokens=False)

    def finish(self, conv: Rewrite, entry: dict) -> None:
        """A response finished now: stored durably first (a kill after this loses nothing), then applied."""
        self.journal.append(entry)
        faults.point("regenerate:stored")
        self.apply(conv, entry, "generated")

    def apply(self, conv: Rewrite, entry: dict, origin: str) -> None:
        position = conv.positions[conv.done]
        self.turns.append(dict(source_row=conv.source_row, turn=conv.done, message_index=position,
                               finish_reason=entry["finish_reason"], tokens_before=conv.tokens_before[conv.done],
                               tokens_after=entry["num_tokens"], origin=origin, error=entry["error"]))
        conv.done += 1
        if entry["finish_reason"] == "error":
            conv.stop = f"regenerate_error: turn {conv.done - 1}: {entry['error']}"
            return
        if entry["finish_reason"] == "length" and self.settings.truncated == "drop":
            conv.stop = (f"regenerate_truncated: turn {conv.done - 1} was cut at "
                         f"{entry['num_tokens']} new tokens (regenerate.truncated: drop)")
            return
        message = self.parser.parse(entry["text"], conv.tools, entry["key"])
        conv.messages[position:position + 1] = [message]


def error_entry(key: str, error: str) -> dict:
    return {"key": key, "text": "", "num_tokens": 0, "finish_reason": "error", "error": error}


def generate(llm, regen: Regenerator, queued: list[tuple[Rewrite, Request]]) -> None:
    """Drive vLLM's engine loop: each conversation's first missing turn is queued; each finished response
    is stored at once and its conversation's following turn queued (continuous batching throughout)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    in_flight: dict[str, tuple[Rewrite, Request]] = {}
    # Progress in the job's log, as extract reports it (tqdm on stderr): conversations done, their rate
    # and ETA, and the generated tokens per second.
    progress = tqdm(total=len(queued), desc="regenerate", unit="conversation", mininterval=5)
    tokens, began = 0, time.perf_counter()

    def submit(conv: Rewrite, request: Request | None) -> None:
        while request is not None:
            request_id = f"{conv.source_row}:{conv.done}"
            try:
                engine.add_request(request_id, TokensPrompt(prompt_token_ids=request.prompt_ids),
                                   regen.sampling_params(request))
            except ValueError as exc:  # vLLM refused this request (its validation errors)
                regen.finish(conv, error_entry(request.key, f"{type(exc).__name__}: {exc}"))
                request = regen.next_request(conv)
                continue
            in_flight[request_id] = (conv, request)
            return
        progress.update(1)  # nothing left to generate for this conversation

    for conv, request in queued:
        submit(conv, request)
    while in_flight:
        if not engine.has_unfinished_requests():
            raise engine_mod.EngineError(f"vLLM has no unfinished requests, but {len(in_flight)} never finished")
        for output in engine.step():
            if not output.finished:
                continue
            conv, request = in_flight.pop(output.request_id)
            completion = output.outputs[0]
            tokens += len(completion.token_ids)
            progress.set_postfix_str(f"{tokens / (time.perf_counter() - began):.0f} tokens/s", refresh=False)
            reason = completion.finish_reason if completion.finish_reason in ("stop", "length") else "error"
            regen.finish(conv, {"key": request.key, "text": completion.text,
                                "num_tokens": len(completion.token_ids), "finish_reason": reason,
                                "error": None if reason != "error" else f"finish_reason={completion.finish_reason}"})
            submit(conv, regen.next_request(conv))
    progress.close()


def engine_settings(job: RegenerateJob) -> dict:
    """`vllm.LLM` arguments: extraction's engine (model, dtype, TP, lengths, batching), without capture."""
    return engine_mod.generation_engine_kwargs(job.model_path, job.dtype, job.max_seq_len, job.engine,
                                               job.trust_remote_code)


def run(job: RegenerateJob, llm=None) -> dict:
    """The stage for one shard; `llm` (a started engine) is for the benchmark: the job starts its own."""
    from transformers import AutoTokenizer

    began = time.perf_counter()
    tokenizer = with_template_kwargs(
        AutoTokenizer.from_pretrained(job.model_path, trust_remote_code=job.trust_remote_code),
        job.chat_template_kwargs)
    kwargs = engine_settings(job)
    start, stop = job.rows
    conversations = [plan(row["source_row"], json.loads(row["record"]), job.settings.turns, tokenizer)
                     for row in read_shard(job.conversations, start, stop)]
    journal = Journal(job.journal)
    regen = Regenerator(job, tokenizer, journal, kwargs["max_model_len"])
    queued = [(c, r) for c in conversations if (r := regen.next_request(c)) is not None]
    logger.info("rows %d..%d: %d conversations, %d turns reused from %s, %d conversations to generate",
                start, stop, len(conversations), sum(t["origin"] == "reused" for t in regen.turns),
                job.journal, len(queued))
    engine_start = 0.0
    if queued and llm is None:
        started = time.perf_counter()
        llm = engine_mod.start_engine(kwargs, job.engine.cpu_kv_cache_gib)
        engine_mod.check_prompt_fits(llm, kwargs["max_model_len"])
        engine_start = time.perf_counter() - started
    generating = time.perf_counter()
    if queued:
        generate(llm, regen, queued)
    generate_seconds = time.perf_counter() - generating
    journal.close()
    stats = write_outputs(job, conversations, regen.turns)
    stats.update(engine_start_seconds=engine_start, generate_seconds=generate_seconds,
                 seconds=time.perf_counter() - began - engine_start)
    generated = sum(t["tokens_after"] for t in regen.turns if t["origin"] == "generated")
    stats["tokens_per_second"] = generated / generate_seconds if generated else None
    atomic_write_text(job.stats, json.dumps(stats, indent=1))
    logger.info("rows %d..%d: %s", start, stop, {k: v for k, v in stats.items() if k != "skipped_rows"})
    return stats


def write_outputs(job: RegenerateJob, conversations: list[Rewrite], turns: list[dict]) -> dict:
    """The regenerated conversations (JSON lines) and the turn table, atomically; the counts."""
    counts = {"regenerated": 0, "original": 0, "skipped": 0}
    original_reasons: dict[str, int] = {}
    skipped = []
    with atomic_path(job.out) as tmp, open(tmp, "w") as f:
        for conv in conversations:
            keep_original = conv.pass_reason or (conv.stop and conv.stop.startswith("regenerate_error")
                                                 and job.settings.keep_original_on_failure)
            if keep_original:
                reason = (conv.pass_reason or conv.stop).split(":")[0]
                original_reasons[reason] = original_reasons.get(reason, 0) + 1
                record, counts["original"] = conv.record, counts["original"] + 1
            elif conv.stop:
                original = normalize(conv.record)
                skipped.append({"sample_id": sample_id(original.messages, original.tools),
                                "source_row": conv.source_row, "source_id": str(conv.record.get("id", "")),
                                "reason": conv.stop})
                counts["skipped"] += 1
                continue
            else:
                rest = {k: v for k, v in conv.record.items() if k not in REPLACED_FIELDS}
                record = {**rest, "messages": conv.messages, **({"tools": conv.tools} if conv.tools else {})}
                counts["regenerated"] += 1
            f.write(json.dumps({"source_row": conv.source_row, "record": record}, ensure_ascii=False) + "\n")
    table = pd.DataFrame(turns, columns=RESPONSE_COLUMNS).astype({"tokens_before": "Int64"})
    with atomic_path(job.responses) as tmp:
        table.to_parquet(tmp, index=False)
    return {
        "conversations_in": len(conversations), **counts, "original_reasons": original_reasons,
        "turns_generated": int((table["origin"] == "generated").sum()),
        "turns_reused": int((table["origin"] == "reused").sum()),
        "finish_reasons": {k: int(v) for k, v in table["finish_reason"].value_counts().items()},
        "truncated": int((table["finish_reason"] == "length").sum()),
        "skipped_rows": skipped,
        "settings": dataclasses.asdict(job.settings),
    }
