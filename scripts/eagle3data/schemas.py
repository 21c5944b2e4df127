"""pandera schemas for every table that crosses a stage boundary, and one way to check them.

Each stage writes a table and the next one reads it; both call `check` so a corrupt or foreign file is
refused at the boundary with every failing row listed (lazy validation), not discovered downstream.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pandera.pandas as pa
from pandera.errors import SchemaErrors
from pandera.typing.pandas import Series


class BoundaryError(ValueError):
    """A table or file that does not match its contract; the message lists every failure."""


def _lengths(values: pd.Series) -> pd.Series:
    return values.map(len)


class TokenizedShard(pa.DataFrameModel):
    """One row per kept sample of a shard, written by `tokenize`."""

    sample_id: Series[str] = pa.Field(unique=True, str_length={"min_value": 8})
    source_row: Series[int] = pa.Field(ge=0)
    source_id: Series[str]
    input_ids: Series[object]
    loss_mask: Series[object]
    num_tokens: Series[int] = pa.Field(ge=1)
    num_trainable: Series[int] = pa.Field(ge=1)
    truncated: Series[bool]
    matches_full_tokenization: Series[bool]

    @pa.dataframe_check(error="len(loss_mask) == len(input_ids) == num_tokens")
    def lengths_agree(cls, df: pd.DataFrame) -> pd.Series:
        ids, mask = _lengths(df["input_ids"]), _lengths(df["loss_mask"])
        return (ids == mask) & (ids == df["num_tokens"])

    @pa.dataframe_check(error="loss_mask holds only 0/1 and sums to num_trainable")
    def mask_is_binary(cls, df: pd.DataFrame) -> pd.Series:
        def ok(mask, trainable):
            m = np.asarray(mask)
            return bool(np.isin(m, (0, 1)).all()) and int(m.sum()) == trainable

        return pd.Series(
            [ok(m, t) for m, t in zip(df["loss_mask"], df["num_trainable"])], index=df.index
        )

    class Config:
        strict = True
        coerce = True


class SkippedShard(pa.DataFrameModel):
    """One row per input conversation that yields no sample, with the reason."""

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


class StatesManifest(pa.DataFrameModel):
    """One row per sample per captured tensor, written by `validate` after checking the files."""

    sample_id: Series[str]
    capture: Series[str]
    slot: Series[int] = pa.Field(ge=0)
    rows: Series[int] = pa.Field(ge=1)
    hidden_size: Series[int] = pa.Field(ge=1)
    dtype: Series[str]
    nbytes: Series[int] = pa.Field(ge=1)
    finite: Series[bool] = pa.Field(isin=[True])
    zero_fraction: Series[float] = pa.Field(ge=0, lt=1)
    mean_norm: Series[float] = pa.Field(ge=0)
    checksum: Series[str]
    path: Series[str]

    @pa.dataframe_check(error="nbytes == rows * hidden_size * itemsize(dtype)")
    def bytes_match_shape(cls, df: pd.DataFrame) -> pd.Series:
        itemsize = df["dtype"].map({"bfloat16": 2, "float16": 2, "float32": 4})
        return df["nbytes"] == df["rows"] * df["hidden_size"] * itemsize

    class Config:
        strict = True
        coerce = True


def check(schema: type[pa.DataFrameModel], df: pd.DataFrame, what: str) -> pd.DataFrame:
    """Validate `df` lazily; raise BoundaryError naming `what`, each failing check and sample."""
    try:
        return schema.validate(df, lazy=True)
    except SchemaErrors as exc:
        failures = exc.failure_cases
        lines = [f"{what}: {len(failures)} check failure(s) against {schema.__name__}:"]
        for _, case in failures.head(50).iterrows():
            index = case.get("index")
            sample = (
                df.loc[index, "sample_id"]
                if "sample_id" in df.columns and index is not None and index in df.index
                else "-"
            )
            lines.append(
                f"  sample={sample} column={case.get('column')} check={case.get('check')} "
                f"found={case.get('failure_case')!r}"
            )
        raise BoundaryError("\n".join(lines)) from None
