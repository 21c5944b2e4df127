"""How much the extract stage will write, and whether the store's disk has room, before any engine starts.

A sample's file is `hidden_states [T, n_captures, H]` plus `token_ids [T]` (int64) and a small header, so
its size follows from its token count alone. Each extract job knows its own shard exactly; the rest of
the input is extrapolated from this shard's bytes per input conversation. The job refuses to start when
the free space on the store's disk is below what is left to write (this shard, plus every shard that has
no extract manifest yet) and the reserve; `storage.check_free_space: false` turns that into a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3data.storage.room import GIB, gib
from eagle3data.plan.shards import conversations_of
from eagle3data.contracts.states import Expected

HEADER_BYTES = 160  # safetensors length prefix + JSON header for the two tensors (152 measured)
FACTS_BYTES_PER_CAPTURE = 240  # the validation facts in the header (states.FACTS_KEY): 210-232 measured
TOKEN_ID_BYTES = 8  # token_ids are int64


@dataclass(frozen=True)
class InputShape:
    """Where a shard sits in the input: its conversations, the input's, and every shard's rows (shards.plan)."""

    shard_conversations: int
    input_conversations: int
    plan: tuple[tuple[int, int], ...]


def sample_bytes(num_tokens: int, expected: Expected) -> int:
    """Size on disk of one sample's states file (at most: the facts' JSON varies by a few bytes)."""
    per_token = expected.token_bytes + TOKEN_ID_BYTES
    return HEADER_BYTES + len(expected.captures) * FACTS_BYTES_PER_CAPTURE + num_tokens * per_token


@dataclass(frozen=True)
class SizeEstimate:
    samples: int
    mean_sample_bytes: float
    max_sample_bytes: int  # a sample of max_seq_len tokens
    shard_bytes: int  # every kept sample of this shard
    todo_bytes: int  # what this job writes (the rest is reused from the store)
    input_bytes: int  # the whole input, extrapolated from this shard
    remaining_bytes: int  # this job's writes + the shards without a manifest yet (extrapolated)

    def describe(self, conversations: int) -> str:
        return (
            f"expected output: {_mib(self.mean_sample_bytes)} per sample on average "
            f"({_mib(self.max_sample_bytes)} at max_seq_len); this shard {self.samples} samples, "
            f"{gib(self.shard_bytes)} ({gib(self.todo_bytes)} to write); whole input "
            f"({conversations} conversations) about {gib(self.input_bytes)}, of which about "
            f"{gib(self.remaining_bytes)} is not written yet"
        )


def estimate(num_tokens: list[int], todo_tokens: list[int], expected: Expected, max_seq_len: int,
             shape: InputShape, finished_conversations: int) -> SizeEstimate:
    """Sizes for a shard whose kept samples have `num_tokens` tokens, `todo_tokens` still to compute."""
    shard_bytes = sum(sample_bytes(t, expected) for t in num_tokens)
    todo_bytes = sum(sample_bytes(t, expected) for t in todo_tokens)
    per_conversation = shard_bytes / max(shape.shard_conversations, 1)
    others_left = max(shape.input_conversations - shape.shard_conversations - finished_conversations, 0)
    return SizeEstimate(
        samples=len(num_tokens),
        mean_sample_bytes=shard_bytes / max(len(num_tokens), 1),
        max_sample_bytes=sample_bytes(max_seq_len, expected),
        shard_bytes=shard_bytes,
        todo_bytes=todo_bytes,
        input_bytes=round(per_conversation * shape.input_conversations),
        remaining_bytes=todo_bytes + round(per_conversation * others_left),
    )


def finished_conversations(manifest: str | Path, plan: tuple[tuple[int, int], ...]) -> int:
    """Conversations of the other shards that already have an extract manifest (their states exist)."""
    manifest = Path(manifest)
    others = [p.stem.removeprefix("shard-") for p in manifest.parent.glob("shard-*.parquet") if p != manifest]
    return conversations_of(plan, [int(number) for number in others if number.isdigit()])


def _mib(n: float) -> str:
    return f"{n / 1024**2:.2f} MiB"


# What a trainer export (eagle3data.exports) writes beyond the packed dataset. An export whose states are
# read in place (`states: reader`, the default) holds the trainer's small files only; one with `states:
# files` holds the states again, decompressed, as the trainer's own reader loads them.
FILE_BLOCK_BYTES = 4096  # a small file takes a whole filesystem block
TABLE_BYTES_PER_TOKEN = 5  # speculators' table: input_ids int32, loss_mask int8
FEATURE_IDS_BYTES_PER_TOKEN = 16  # a SpecForge feature file's input_ids and loss_mask, int64 each
FEATURE_FILE_BYTES = 2048  # a SpecForge feature file beside its tensors: torch's zip entries, the CRC32s


@dataclass(frozen=True)
class ExportShape:
    """What an export's size follows from: the packed dataset's rows and tokens, and the states the
    trainer reads per token (its aux states and the final one)."""

    samples: int
    tokens: int
    states_per_token: int  # n_aux + 1
    hidden_size: int
    itemsize: int
    small_files_bytes: int = 0  # the vocabulary files and the manifest, as the export writes them


def export_bytes(trainer: str, states: str, shape: ExportShape, linked: bool = False) -> int:
    """Bytes on disk an export of `shape` adds to the run (at most, within a block per file): `trainer`
    "speculators" or "specforge", `states` "reader" or "files"; `linked`: a speculators files export whose
    `hs_{i}.safetensors` are hard links to the store's files (no state bytes of its own)."""
    state_bytes = shape.tokens * shape.states_per_token * shape.hidden_size * shape.itemsize
    if trainer == "speculators":
        own = _blocks(shape.tokens * TABLE_BYTES_PER_TOKEN) + shape.small_files_bytes
        if states == "files" and not linked:
            own += state_bytes + shape.tokens * TOKEN_ID_BYTES + shape.samples * FILE_BLOCK_BYTES
        return own
    if trainer == "specforge":
        if states == "reader":  # a pointer file per row
            return shape.samples * FILE_BLOCK_BYTES + shape.small_files_bytes
        return (state_bytes + shape.tokens * FEATURE_IDS_BYTES_PER_TOKEN
                + shape.samples * (FEATURE_FILE_BYTES + FILE_BLOCK_BYTES) + shape.small_files_bytes)
    raise ValueError(f"export_bytes: expected trainer speculators or specforge, found {trainer!r}")


def describe_export(trainer: str, states: str, shape: ExportShape, dataset_bytes: int, linked: bool = False) -> str:
    """One line of the disk plan: what this export costs, and what the other `states` would."""
    other = "files" if states == "reader" else "reader"
    cost, alternative = export_bytes(trainer, states, shape, linked), export_bytes(trainer, other, shape, linked)
    return (f"disk: the {trainer} export (states: {states}) adds about {human_bytes(cost)} to the run "
            f"({cost / max(dataset_bytes, 1):.3f}x the packed dataset's {human_bytes(dataset_bytes)}); "
            f"states: {other} would add about {human_bytes(alternative)} ({alternative / max(dataset_bytes, 1):.3f}x)")


def _blocks(n: int) -> int:
    return -(-n // FILE_BLOCK_BYTES) * FILE_BLOCK_BYTES


def human_bytes(n: float) -> str:
    return gib(n) if n >= GIB / 10 else _mib(n)
