"""pandera contracts for every table that crosses a stage boundary: one class per contract, here only.

Each stage checks what it reads and writes against these lazily, so a corrupt or foreign table is
refused at the boundary with every failing sample listed (failures.py renders them), not discovered
downstream. What a table must satisfy on its own is in the base class, which readers without the run's
settings use; what depends on the run (vocabulary, length policy, captures, hidden size, dtype) is added
by a subclass that a `*_contract` function builds from those settings.

Custom checks are worded as relations between the row's columns (`len(loss_mask) == len(input_ids)`):
that wording is how failures.py shows each failure's expected and found values.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.typing.pandas import Series

from eagle3data.contracts.dtypes import ITEMSIZES
from eagle3data.contracts.failures import BoundaryError, check  # noqa: F401  (the boundary API, used by every stage)

STATE_KEYS = ("hidden_states", "token_ids")


def _lengths(values: pd.Series) -> pd.Series:
    return values.map(len)


def _has(df: pd.DataFrame, tensor: str) -> pd.Series:
    return df["tensors"].map(lambda names: tensor in names)


class TokenizedShard(pa.DataFrameModel):
    """One row per kept sample of a shard, written by `tokenize`.

    The facts after `matches_full_tokenization` describe the sample's trained turns (after truncation);
    `tokenize` always writes them, and they are optional so that shards of bare token prompts (the
    engine checks' and benchmarks' synthetic shards) stay valid. `part` numbers the samples of one
    conversation (0 for the first; a conversation splits where the template rewrites earlier turns);
    `reasoning_tokens` and `tool_call_tokens` count the trainable tokens of the turns' reasoning text and
    of what their tool calls add to the turn (a truncated turn loses its end: its calls first, its
    reasoning last); `reasoning_not_rendered` counts trained turns that carry reasoning the template
    does not render."""

    sample_id: Series[str] = pa.Field(unique=True, str_length={"min_value": 8})
    source_row: Series[int] = pa.Field(ge=0)
    source_id: Series[str]
    input_ids: Series[object]
    loss_mask: Series[object]
    num_tokens: Series[int] = pa.Field(ge=1)
    num_trainable: Series[int] = pa.Field(ge=1)
    truncated: Series[bool]
    matches_full_tokenization: Series[bool]
    part: Optional[Series[int]] = pa.Field(ge=0)
    has_tool_calls: Optional[Series[bool]]
    has_reasoning: Optional[Series[bool]]
    reasoning_not_rendered: Optional[Series[int]] = pa.Field(ge=0)
    reasoning_tokens: Optional[Series[int]] = pa.Field(ge=0)
    tool_call_tokens: Optional[Series[int]] = pa.Field(ge=0)

    @pa.dataframe_check(error="reasoning_tokens + tool_call_tokens <= num_trainable")
    def role_tokens_trainable(cls, df: pd.DataFrame) -> pd.Series:
        if not {"reasoning_tokens", "tool_call_tokens"} <= set(df.columns):
            return pd.Series(True, index=df.index)
        return df["reasoning_tokens"] + df["tool_call_tokens"] <= df["num_trainable"]

    @pa.dataframe_check(error="has_reasoning == (reasoning_tokens > 0)")
    def reasoning_counted(cls, df: pd.DataFrame) -> pd.Series:
        if not {"has_reasoning", "reasoning_tokens"} <= set(df.columns):
            return pd.Series(True, index=df.index)
        return df["has_reasoning"] == (df["reasoning_tokens"] > 0)

    @pa.dataframe_check(error="has_tool_calls == (tool_call_tokens > 0)")
    def tool_calls_counted(cls, df: pd.DataFrame) -> pd.Series:
        if not {"has_tool_calls", "tool_call_tokens"} <= set(df.columns):
            return pd.Series(True, index=df.index)
        return df["has_tool_calls"] == (df["tool_call_tokens"] > 0)

    @pa.dataframe_check(error="len(input_ids) == num_tokens")
    def ids_length(cls, df: pd.DataFrame) -> pd.Series:
        return _lengths(df["input_ids"]) == df["num_tokens"]

    @pa.dataframe_check(error="len(loss_mask) == len(input_ids)")
    def mask_length(cls, df: pd.DataFrame) -> pd.Series:
        return _lengths(df["loss_mask"]) == _lengths(df["input_ids"])

    @pa.check("loss_mask", error="set(loss_mask) <= [0, 1]")
    def mask_is_binary(cls, mask: pd.Series) -> pd.Series:
        return mask.map(lambda m: bool(np.isin(np.asarray(m), (0, 1)).all()))

    @pa.dataframe_check(error="sum(loss_mask) == num_trainable")
    def trainable_count(cls, df: pd.DataFrame) -> pd.Series:
        return df["loss_mask"].map(lambda m: int(np.sum(m))) == df["num_trainable"]

    @pa.check("input_ids", error="min(input_ids) >= 0")
    def ids_non_negative(cls, ids: pd.Series) -> pd.Series:
        return ids.map(lambda v: len(v) == 0 or int(np.min(v)) >= 0)

    class Config:
        strict = True
        coerce = True


@functools.lru_cache
def tokenized_contract(vocab_size: int, min_seq_len: int, max_seq_len: int) -> type[TokenizedShard]:
    """A tokenized shard of this run: ids inside the model's vocabulary, lengths inside the policy."""

    class TokenizedShardOfRun(TokenizedShard):
        num_tokens: Series[int] = pa.Field(in_range={"min_value": min_seq_len, "max_value": max_seq_len})

        @pa.check("input_ids", error=f"max(input_ids) < {vocab_size}")
        def ids_in_vocabulary(cls, ids: pd.Series) -> pd.Series:
            return ids.map(lambda v: len(v) == 0 or int(np.max(v)) < vocab_size)

    return TokenizedShardOfRun


class SkippedShard(pa.DataFrameModel):
    """One row per input conversation that yields no sample, with the reason (also: quarantined ones)."""

    sample_id: Series[str]
    source_row: Series[int] = pa.Field(ge=0)
    source_id: Series[str]
    reason: Series[str] = pa.Field(str_length={"min_value": 1})

    class Config:
        strict = True
        coerce = True


class ExtractManifest(pa.DataFrameModel):
    """One row per sample of a shard whose states are in the store, written by `extract`."""

    sample_id: Series[str] = pa.Field(unique=True)
    num_tokens: Series[int] = pa.Field(ge=1)
    path: Series[str]
    status: Series[str] = pa.Field(isin=["computed", "reused"])

    class Config:
        strict = True
        coerce = True


class ExtractCoverage(pa.DataFrameModel):
    """One row per sample id of a tokenized shard or its extract manifest: each lists it exactly once."""

    sample_id: Series[str] = pa.Field(unique=True)
    times_tokenized: Series[int]
    times_extracted: Series[int]

    @pa.check("times_tokenized", error="times_tokenized == 1")
    def tokenized_once(cls, times: pd.Series) -> pd.Series:
        return times == 1

    @pa.check("times_extracted", error="times_extracted == 1")
    def extracted_once(cls, times: pd.Series) -> pd.Series:
        return times == 1

    class Config:
        strict = True


def extract_coverage(tokenized: pd.DataFrame, extracted: pd.DataFrame) -> pd.DataFrame:
    """The ExtractCoverage table of an extract manifest against its tokenized shard."""
    counts = pd.DataFrame(
        {
            "times_tokenized": tokenized["sample_id"].value_counts(),
            "times_extracted": extracted["sample_id"].value_counts(),
        }
    )
    counts = counts.fillna(0).astype(int).rename_axis("sample_id").reset_index()
    return counts[list(ExtractCoverage.to_schema().columns)]


class StatesFile(pa.DataFrameModel):
    """One row per sample: what its states file holds (header, token ids), beside its tokenized ids."""

    sample_id: Series[str] = pa.Field(unique=True)
    path: Series[str]
    read_error: Series[str]
    tensors: Series[object]
    shape: Series[object]
    dtype: Series[str]
    token_ids: Series[object]
    input_ids: Series[object]

    @pa.check("read_error", error="read_error == ''")
    def readable(cls, error: pd.Series) -> pd.Series:
        return error == ""

    @pa.dataframe_check(error=f"tensors == {list(STATE_KEYS)}")
    def exactly_the_state_tensors(cls, df: pd.DataFrame) -> pd.Series:
        return (df["read_error"] != "") | df["tensors"].map(lambda names: list(names) == list(STATE_KEYS))

    @pa.dataframe_check(error="token_ids == input_ids")
    def token_ids_match(cls, df: pd.DataFrame) -> pd.Series:
        same = [list(a) == list(map(int, b)) for a, b in zip(df["token_ids"], df["input_ids"])]
        return ~_has(df, "token_ids") | pd.Series(same, index=df.index, dtype=bool)

    class Config:
        strict = True


@functools.lru_cache
def states_file_contract(n_captures: int, hidden_size: int, dtype: str) -> type[StatesFile]:
    """A states file of this run: `hidden_states [tokens, n_captures, hidden_size]` in `dtype`."""

    class StatesFileOfRun(StatesFile):
        @pa.dataframe_check(error=f"shape == [len(input_ids), {n_captures}, {hidden_size}]")
        def states_shape(cls, df: pd.DataFrame) -> pd.Series:
            same = [list(shape) == [len(ids), n_captures, hidden_size]
                    for shape, ids in zip(df["shape"], df["input_ids"])]
            return ~_has(df, "hidden_states") | pd.Series(same, index=df.index, dtype=bool)

        @pa.dataframe_check(error=f"dtype == '{dtype}'")
        def states_dtype(cls, df: pd.DataFrame) -> pd.Series:
            return ~_has(df, "hidden_states") | (df["dtype"] == dtype)

    return StatesFileOfRun


class StatesManifest(pa.DataFrameModel):
    """One row per sample per captured tensor, written by `validate` after measuring each file."""

    sample_id: Series[str]
    capture: Series[str]
    slot: Series[int] = pa.Field(ge=0)
    rows: Series[int] = pa.Field(ge=1)
    hidden_size: Series[int] = pa.Field(ge=1)
    dtype: Series[str] = pa.Field(isin=list(ITEMSIZES))
    nbytes: Series[int]
    nonfinite: Series[int]
    zero_fraction: Series[float] = pa.Field(ge=0, le=1)
    zero_rows: Series[int]
    identical_rows: Series[bool]
    mean_norm: Series[float] = pa.Field(nullable=True)
    checksum: Series[str] = pa.Field(str_length=8)
    path: Series[str]

    @pa.check("nonfinite", error="nonfinite == 0")
    def finite(cls, count: pd.Series) -> pd.Series:
        return count == 0

    @pa.check("zero_fraction", error="zero_fraction < 1")
    def not_all_zero(cls, fraction: pd.Series) -> pd.Series:
        return fraction < 1

    @pa.check("zero_rows", error="zero_rows == 0")
    def no_zero_token(cls, count: pd.Series) -> pd.Series:
        return count == 0

    @pa.check("identical_rows", error="identical_rows == False")
    def tokens_differ(cls, identical: pd.Series) -> pd.Series:
        return ~identical

    @pa.dataframe_check(error="nbytes == rows * hidden_size * itemsize(dtype)")
    def bytes_match_shape(cls, df: pd.DataFrame) -> pd.Series:
        return df["nbytes"] == df["rows"] * df["hidden_size"] * df["dtype"].map(ITEMSIZES)

    class Config:
        strict = True
        coerce = True


@functools.lru_cache
def states_manifest_contract(width: int, state_dtype: str) -> type[StatesManifest]:
    """A states manifest of this run: every capture `width` (the hidden size) wide, in `state_dtype`."""

    class StatesManifestOfRun(StatesManifest):
        hidden_size: Series[int] = pa.Field(eq=width)
        dtype: Series[str] = pa.Field(eq=state_dtype)

    return StatesManifestOfRun


class SampleStates(pa.DataFrameModel):
    """One row per sample of a tokenized shard or its states manifest: the sample's captures, as listed."""

    sample_id: Series[str] = pa.Field(unique=True)
    times_tokenized: Series[int]
    num_tokens: Series[int]
    captures: Series[object]
    rows: Series[object]
    duplicate_captures: Series[object]
    path: Series[str]

    @pa.check("times_tokenized", error="times_tokenized == 1")
    def tokenized_once(cls, times: pd.Series) -> pd.Series:
        return times == 1

    @pa.dataframe_check(error="rows == [num_tokens]")
    def one_row_per_token(cls, df: pd.DataFrame) -> pd.Series:
        same = [list(rows) == [n] for rows, n in zip(df["rows"], df["num_tokens"])]
        return (_lengths(df["captures"]) == 0) | pd.Series(same, index=df.index, dtype=bool)

    @pa.check("duplicate_captures", error="duplicate_captures == []")
    def captures_differ(cls, duplicates: pd.Series) -> pd.Series:
        return _lengths(duplicates) == 0

    class Config:
        strict = True
        coerce = True  # an empty table (every sample of the shard quarantined) has no dtypes


@functools.lru_cache
def sample_states_contract(capture_names: tuple[str, ...]) -> type[SampleStates]:
    """Every sample of this run holds exactly the configured captures, in slot order."""

    class SampleStatesOfRun(SampleStates):
        @pa.check("captures", error=f"captures == {list(capture_names)}")
        def configured_captures(cls, captures: pd.Series) -> pd.Series:
            return captures.map(lambda names: list(names) == list(capture_names))

    return SampleStatesOfRun


class ManifestEntry(NamedTuple):
    """One capture of a sample, as its states manifest row lists it."""

    capture: str
    slot: int
    rows: int
    checksum: str
    path: str


def entries_by_sample(manifest: pd.DataFrame) -> dict[str, list[ManifestEntry]]:
    """Each sample's rows of a states manifest, in slot order, in one pass over the table (a pandas frame
    per sample cost validate 3 of its 4 seconds on a 702-sample shard)."""
    ordered = manifest.sort_values(["sample_id", "slot"], kind="stable")
    by_sample: dict[str, list[ManifestEntry]] = {}
    for sid, *fields in zip(ordered["sample_id"], *(ordered[name] for name in ManifestEntry._fields)):
        by_sample.setdefault(sid, []).append(ManifestEntry(*fields))
    return by_sample


def sample_states(manifest: pd.DataFrame, tokenized: pd.DataFrame) -> pd.DataFrame:
    """The SampleStates table of a states manifest against the tokenized samples it must cover.

    `duplicate_captures` names captures whose checksum equals an earlier capture's: two slots holding
    the same tensor (a capture written twice, or the wrong layer)."""
    tokens = tokenized.groupby("sample_id")["num_tokens"].agg(["size", "first"])
    listed = entries_by_sample(manifest)
    times, first = tokens["size"].to_dict(), tokens["first"].to_dict()
    rows = []
    for sid in sorted(set(times) | set(listed)):
        entries = listed.get(sid, [])
        distinct = {}  # each capture's first entry, in slot order
        for entry in entries:
            distinct.setdefault(entry.capture, entry.checksum)
        seen, duplicates = set(), []
        for capture, checksum in distinct.items():
            if checksum in seen:
                duplicates.append(capture)
            seen.add(checksum)
        rows.append(
            {
                "sample_id": sid,
                "times_tokenized": int(times.get(sid, 0)),
                "num_tokens": int(first.get(sid, 0)),
                "captures": [e.capture for e in entries],
                "rows": sorted({e.rows for e in entries}),
                "duplicate_captures": duplicates,
                "path": str(entries[0].path) if entries else "",
            }
        )
    return pd.DataFrame(rows, columns=list(SampleStates.to_schema().columns))


class PackedRows(pa.DataFrameModel):
    """One row per packed sample: lengths and counts read from the Arrow dataset, not the states."""

    sample_id: Series[str] = pa.Field(unique=True)
    seq_len: Series[int] = pa.Field(ge=1)
    ids_length: Series[int]
    mask_length: Series[int]
    state_rows: Series[int]
    trainable: Series[int]
    non_binary_mask: Series[int]

    @pa.dataframe_check(error="ids_length == seq_len")
    def ids_whole(cls, df: pd.DataFrame) -> pd.Series:
        return df["ids_length"] == df["seq_len"]

    @pa.dataframe_check(error="mask_length == seq_len")
    def mask_whole(cls, df: pd.DataFrame) -> pd.Series:
        return df["mask_length"] == df["seq_len"]

    @pa.dataframe_check(error="state_rows == seq_len")
    def states_whole(cls, df: pd.DataFrame) -> pd.Series:
        return df["state_rows"] == df["seq_len"]

    @pa.check("trainable", error="trainable >= 1")
    def has_trainable(cls, count: pd.Series) -> pd.Series:
        return count >= 1

    @pa.check("non_binary_mask", error="non_binary_mask == 0")
    def mask_is_binary(cls, count: pd.Series) -> pd.Series:
        return count == 0

    class Config:
        strict = True
