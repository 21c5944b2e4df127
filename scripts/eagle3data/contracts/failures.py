"""Failures of a table against its contract, as sample / check / expected / found: never just "invalid".

pandera's lazy validation collects every failing row of every check at once; this module turns its
failure cases into one `Failure` per (sample, check). The contracts in `schemas.py` word each custom
check as a relation between columns of the row, e.g. `shape == [len(input_ids), 4, 128]`, so a failure
renders with the row's own values: expected [512, 4, 128], found [771]. pandera's built-in checks
(`unique`, `ge`, dtype coercion) render as their name and the failing value.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from pandera.errors import SchemaErrors

# `lhs op rhs` where lhs and rhs may name columns of the row, or `f(column)` for f in _FUNCTIONS.
_RELATION = re.compile(r"^(?P<lhs>.+?) (?P<op>==|<=|>=|<|>) (?P<rhs>.+)$")
_TERM = re.compile(
    r"(?P<quoted>'[^']*')|\b(?:(?P<func>len|sum|min|max|set)\((?P<arg>\w+)\)|(?P<name>[A-Za-z_]\w*))"
)
_FUNCTIONS = {
    "len": len,
    "sum": lambda v: int(np.sum(v)),
    "min": lambda v: int(np.min(v)) if len(v) else None,
    "max": lambda v: int(np.max(v)) if len(v) else None,
    "set": lambda v: sorted({int(x) for x in v}),
}
_SHOWN = 6  # values of a long list shown in a message


class BoundaryError(ValueError):
    """A table or file that does not match its contract; the message lists every failure."""


@dataclass(frozen=True)
class Failure:
    sample_id: str  # "-" when the failure is the table's (a missing column), not a sample's
    check: str
    expected: str
    found: str
    file: str

    def __str__(self) -> str:
        return (
            f"sample {self.sample_id} | check {self.check} | expected {self.expected} | "
            f"found {self.found} | file {self.file}"
        )


def show(value) -> str:
    """A value for a message: lists longer than a few items as their length and first items."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        items = ", ".join(show(v) for v in value[:_SHOWN])
        return f"[{len(value)} items: {items}, ...]" if len(value) > _SHOWN else f"[{items}]"
    return repr(value) if isinstance(value, str) else str(value)


def _column(match: re.Match, row: pd.Series) -> bool:
    return not match["quoted"] and (match["arg"] or match["name"]) in row.index


def _value(match: re.Match, row: pd.Series):
    if match["func"]:
        return _FUNCTIONS[match["func"]](row[match["arg"]])
    return row[match["name"]]


def _evaluate(expr: str, row: pd.Series) -> tuple[object, str]:
    """(value, text) of `expr` on `row`: a single column term's value, else None and the expression
    with each column term replaced by its value."""
    whole = _TERM.fullmatch(expr)
    if whole and _column(whole, row):
        value = _value(whole, row)
        return value, show(value)
    return None, _TERM.sub(lambda m: show(_value(m, row)) if _column(m, row) else m[0], expr)


def _first_difference(found, expected) -> str:
    for i, (a, b) in enumerate(zip(found, expected)):
        if a != b:
            return f" (first difference at position {i}: {show(a)} where {show(b)} was expected)"
    return ""


def _render(relation: str, row: pd.Series) -> tuple[str, str]:
    """(expected, found) of a relation check on one row."""
    m = _RELATION.match(relation)
    (found, found_text), (expected, expected_text) = _evaluate(m["lhs"], row), _evaluate(m["rhs"], row)
    if isinstance(found, (list, np.ndarray)) and isinstance(expected, (list, np.ndarray)):
        found_text += _first_difference(list(found), list(expected))
    op = "" if m["op"] == "==" else f"{m['op']} "
    return f"{op}{expected_text}", found_text


def validate(schema, df: pd.DataFrame, file: str) -> tuple[pd.DataFrame, list[Failure]]:
    """`df` validated lazily against `schema`: (the coerced table, []) or (`df`, every failure)."""
    df = df.reset_index(drop=True)
    try:
        return schema.validate(df, lazy=True), []
    except SchemaErrors as exc:
        return df, _failures(exc.failure_cases, df, file)


def _failures(cases: pd.DataFrame, df: pd.DataFrame, file: str) -> list[Failure]:
    """One Failure per (row, check) of pandera's failure cases."""
    out = []
    for (index, check), group in cases.groupby(["index", "check"], dropna=False, sort=False):
        column, value = group["column"].iloc[0], group["failure_case"].iloc[0]
        if index is None or pd.isna(index):
            out.append(Failure("-", f"{column}: {check}", str(check), show(value), file))
            continue
        row = df.loc[int(index)]
        sample = str(row.get("sample_id", "-"))
        where = str(row.get("path") or file)
        of = f" (capture {row['capture']})" if "capture" in row.index else ""
        if _RELATION.match(str(check)):
            expected, found = _render(str(check), row)
            out.append(Failure(sample, f"{check}{of}", expected, found, where))
        else:
            out.append(Failure(sample, f"{column}: {check}{of}", str(check), show(value), where))
    return out


def summary(title: str, found: Iterable[Failure], total: int, files: Iterable[str]) -> str:
    """A header (how many samples failed, which files to look at) and one line per failure."""
    found = sorted(found, key=lambda f: f.sample_id)  # stable: a sample's failures stay in check order
    samples = {f.sample_id for f in found} - {"-"}
    table = " and the table itself" if any(f.sample_id == "-" for f in found) else ""
    lines = [
        f"{title}: {len(samples)} of {total} sample(s){table} failed {len(found)} check(s).",
        f"Files to look at: {', '.join(dict.fromkeys(files))}, and the file named on each line.",
    ]
    return "\n".join(lines + [f"  {f}" for f in found])


def check(schema, df: pd.DataFrame, what: str) -> pd.DataFrame:
    """Validate `df` lazily; raise BoundaryError listing every failing sample and check of `what`."""
    valid, found = validate(schema, df, what)
    if found:
        raise BoundaryError(summary(f"{what} does not match {schema.__name__}", found, len(df), [what]))
    return valid
