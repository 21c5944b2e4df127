"""Every line of the input read once while the run is planned: broken lines named by file and line.

A line that is not JSON, or JSON that is not an object, is an error naming `file:line`, not a recorded
skip: it is a damaged file (a download or a concatenation cut mid-row), which a skip would hide while
it drops rows the user meant to train on. A row that is JSON but holds no trainable conversation (no
assistant turn, an unknown role, no conversation field) stays a recorded skip of tokenize, with its
reason; only an input in which no row could be a conversation is an error.

The read costs about 2.5 s per million rows of 1.3 KB on one core (msgspec, which vLLM installs; 5.4 s
with the standard json module), counting them 0.8 s of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from eagle3data.utils.problems import Problem
from eagle3data.inputs.conversations import OPENAI_ROLES, SHAREGPT_ROLES

SHOWN_LINES = 3  # broken lines named one by one; the rest are counted
SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class InputScan:
    """What the read found: rows (as the shard plan counts them), the broken ones, whether any is usable."""

    rows: int = 0
    broken: list[tuple[int, str]] = field(default_factory=list)  # (file line, what is wrong), the first few
    n_broken: int = 0
    usable: bool = False


def _loads():
    try:
        import msgspec

        decoder = msgspec.json.Decoder()
        return decoder.decode, (msgspec.DecodeError, UnicodeDecodeError)
    except ImportError:  # the standard module: about twice as slow
        return json.loads, (json.JSONDecodeError, UnicodeDecodeError)


def could_train(record, regenerate: bool) -> bool:
    """Whether a row may yield a sample: a conversation with an assistant turn (with regeneration on, any
    turn: the target writes the answer). The forms are conversations.normalize's."""
    if not isinstance(record, dict):
        return False
    if isinstance(record.get("messages"), list):
        turns, key, roles = record["messages"], "role", OPENAI_ROLES
    elif isinstance(record.get("conversations"), list):
        turns, key, roles = record["conversations"], "from", SHAREGPT_ROLES
    else:
        return False
    if regenerate:
        return bool(turns)
    for turn in turns:
        if isinstance(turn, dict):
            role = turn.get(key)
            if roles.get(str(role).lower() if key == "from" else role) == "assistant":
                return True
    return False


def _why(line: bytes) -> str:
    """The standard module's words for a line that does not parse."""
    try:
        value = json.loads(line)
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start})"
    except json.JSONDecodeError as exc:
        return _json_error(exc)
    return f"a JSON {type(value).__name__}, not an object"


def _json_error(exc: json.JSONDecodeError) -> str:
    return f"not JSON: {exc.msg.removesuffix(' at')} at column {exc.colno}"


def scan_jsonl(path: Path, regenerate: bool) -> InputScan:
    loads, errors = _loads()
    scan = InputScan()
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            scan.rows += 1
            try:
                record = loads(line)
            except errors:
                record = None
            if not isinstance(record, dict):
                scan.n_broken += 1
                if len(scan.broken) < SHOWN_LINES:
                    scan.broken.append((number, _why(line)))
                continue
            if not scan.usable:
                scan.usable = could_train(record, regenerate)
    return scan


def scan_json(path: Path, regenerate: bool) -> InputScan:
    scan = InputScan()
    try:
        rows = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        scan.n_broken, scan.broken = 1, [(exc.lineno, _json_error(exc))]
        return scan
    except UnicodeDecodeError as exc:
        scan.n_broken, scan.broken = 1, [(1, f"not UTF-8 text (byte {exc.start})")]
        return scan
    if not isinstance(rows, list):
        scan.n_broken, scan.broken = 1, [(1, f"a JSON {type(rows).__name__}; a .json input is a list of rows")]
        return scan
    scan.rows = len(rows)
    for index, record in enumerate(rows):
        if not isinstance(record, dict):
            scan.n_broken += 1
            if len(scan.broken) < SHOWN_LINES:
                scan.broken.append((0, f"row {index} is a JSON {type(record).__name__}, not an object"))
        elif not scan.usable:
            scan.usable = could_train(record, regenerate)
    return scan


def scan_parquet(path: Path, regenerate: bool) -> InputScan:
    """Rows from the footer; usable where a row of the first row group holding a conversation column is."""
    file = pq.ParquetFile(path)
    scan = InputScan(rows=file.metadata.num_rows)
    columns = [c for c in ("messages", "conversations") if c in file.schema_arrow.names]
    if scan.rows and columns:
        for group in range(file.num_row_groups):
            rows = file.read_row_group(group, columns=columns).to_pylist()
            if any(could_train(row, regenerate) for row in rows):
                scan.usable = True
                break
    return scan


def input_problems(path: str | Path, regenerate: bool = False) -> tuple[InputScan | None, list[Problem]]:
    """The input's scan and its problems: absent, of an unknown kind, broken rows (file:line), empty,
    or no row that could be a conversation."""
    path = Path(path)
    key = "input"
    if not path.is_file():
        found = "is a directory" if path.is_dir() else "does not exist"
        return None, [Problem(key, f"{path} {found}.", "a .jsonl, .json or .parquet file of conversations",
                              "point input at the file (a path relative to the directory snakemake runs in).")]
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        return None, [Problem(key, f"{path} is a {suffix or 'suffix-less'} file.",
                              "a .jsonl, .json or .parquet file of conversations",
                              "convert it, or rename a JSON Lines file to .jsonl.")]
    scan = {".jsonl": scan_jsonl, ".json": scan_json, ".parquet": scan_parquet}[suffix](path, regenerate)
    problems = []
    if scan.n_broken:
        where = ", ".join(f"line {n}" if n else "" for n, _ in scan.broken if n)
        first_line, why = scan.broken[0]
        lines = [f"{path}:{first_line}: {why}." if first_line else f"{path}: {why}."]
        lines += [f"  {path}:{n}: {w}." for n, w in scan.broken[1:]]
        more = scan.n_broken - len(scan.broken)
        if more:
            lines.append(f"  ... and {more} more broken row{'s' if more > 1 else ''} ({scan.n_broken} in all).")
        lines.append("  Allowed: one JSON object (a conversation) per line; broken rows are not skipped.")
        lines.append(f"  Do: fix or delete the row{'s' if scan.n_broken > 1 else ''}"
                     f"{f' ({where})' if where else ''}; a file cut mid-row is an unfinished copy.")
        problems.append(Problem(f"{path}:{first_line}", lines=tuple(lines)))
    elif scan.rows == 0:
        problems.append(Problem(key, f"{path} holds no rows.", "at least one conversation",
                                "point input at the file of conversations (is it the one still being written?)."))
    elif not scan.usable:
        what = "an assistant turn" if not regenerate else "a turn"
        problems.append(Problem(key, f"none of the {scan.rows:,} rows of {path} is a conversation with {what}.",
                                "rows with messages: [{role, content}] (OpenAI) or conversations: "
                                "[{from, value}] (ShareGPT)",
                                "see docs/input-formats.md; every row would be skipped."))
    return scan, problems
