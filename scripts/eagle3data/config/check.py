"""Config validation whose errors fit in a screen.

Why: `snakemake.utils.validate` reports a config that breaks config/schema.yaml with jsonschema's own
message, which prints the whole schema and the whole config: 1,579 lines for a one-letter typo in a
top-level key. `schema_problems` checks the config against the same schema first (Draft 2020-12, as
Snakemake does) and words every violation as a `Problem` of a few lines: the key path, what was found,
what is allowed, and for an unknown key the known names nearest to it. `validate_config` raises them
all at once as a `ConfigError`; a valid config then goes through `snakemake.utils.validate`, which fills
in the schema's defaults: the one place they are filled.
"""

from __future__ import annotations

import difflib
import json
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from eagle3data.utils.problems import MAX_PROBLEM_LINES, Problem

if TYPE_CHECKING:
    from jsonschema.exceptions import ValidationError

MAX_LISTED_KEYS = 15  # an unknown key's message lists the allowed keys of its level up to this many
WIDTH = 100  # characters of a line, beyond which a list of keys wraps and a description is cut
MAX_VALUE_CHARS = 80  # a found value is shown up to this many characters

# JSON Schema's names of the Python types a YAML config holds (bool before int: True is an int).
TYPE_NAMES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"),
              (list, "array"), (dict, "object"))


class ConfigError(ValueError):
    """The config breaks config/schema.yaml; the message says where, what was found and what is allowed."""


def validate_config(config: dict, schema_path: str | os.PathLike) -> None:
    """Check `config` against the schema at `schema_path` and fill in the schema's defaults in place.

    Raises ConfigError naming every problem, each in a few lines."""
    problems = schema_problems(config, schema_path)
    if problems:
        raise ConfigError(_message(problems, schema_path))
    fill_defaults(config, schema_path)


def fill_defaults(config: dict, schema_path: str | os.PathLike) -> None:
    """Fill in the schema's defaults of a config that `schema_problems` found valid."""
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate

    try:
        validate(config, str(schema_path), set_default=True)
    except WorkflowError:
        # Only a default that breaks the schema gets here: report it as briefly as any other problem.
        problems = schema_problems(config, schema_path)
        if problems:
            raise ConfigError(_message(problems, schema_path)) from None
        raise


def schema_problems(config: dict, schema_path: str | os.PathLike) -> list[Problem]:
    """Every violation of the schema at `schema_path`, in the config's key order, each a `Problem`."""
    from jsonschema import Draft202012Validator

    schema = yaml.safe_load(Path(schema_path).read_text())
    errors = sorted(Draft202012Validator(schema).iter_errors(config), key=lambda e: [str(p) for p in e.absolute_path])
    return [Problem(key_path(list(e.absolute_path)), lines=tuple(describe(e))) for e in errors]


def _message(problems: list[Problem], schema_path: str | os.PathLike) -> str:
    lines = [line for problem in problems for line in problem.text()]
    return "\n".join([*lines, f"  Keys, their types and defaults: {shown_path(schema_path)}"])


def shown_path(schema_path: str | os.PathLike) -> str:
    """The schema as the user knows it: `workflow.source_path` hands a copy in Snakemake's source cache,
    flagged with the original path; relative to the working directory where it lies below it."""
    original = getattr(schema_path, "flags", {}).get("sourcecache_entry") or schema_path
    path = os.path.normpath(os.path.abspath(original))
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def describe(error: ValidationError) -> list[str]:
    """At most eight lines about one schema violation: where, what was found, what is allowed."""
    path = list(error.absolute_path)
    where = key_path(path)
    kind = error.validator
    lines: list[str]
    if kind == "additionalProperties" and error.validator_value is False:
        lines = _unknown_keys(error, path)
    elif kind == "required":
        missing = [key for key in error.validator_value if key not in error.instance]
        lines = [f"Invalid config: missing key {', '.join(key_path(path + [k]) for k in missing)}."]
        about = error.schema.get("properties", {}).get(missing[0], {}) if missing else {}
        lines += _about(key_path(path + missing[:1]), about)
    elif kind == "not" and isinstance(error.validator_value, dict):
        # An exclusion (`not: {required: [a, b]}`): name the keys and say why, from its description.
        keys = error.validator_value.get("required", [])
        names = " and ".join(key_path(path + [k]) for k in keys) or where
        lines = [f"Invalid config: {names} cannot be set together."]
        if isinstance(error.instance, dict) and keys:
            lines.append("  Found: " + ", ".join(f"{k}: {show(error.instance.get(k))}" for k in keys))
        if error.validator_value.get("description"):
            lines += textwrap.wrap(error.validator_value["description"], WIDTH, initial_indent="  ",
                                   subsequent_indent="  ", max_lines=2, placeholder="...")
    else:
        problem = {
            "type": "has the wrong type", "enum": "is not one of the allowed values",
            "const": "is not the allowed value", "pattern": "does not match the allowed pattern",
            "minimum": "is too small", "exclusiveMinimum": "is too small", "maximum": "is too large",
            "exclusiveMaximum": "is too large", "minItems": "has too few items",
            "maxItems": "has too many items", "minLength": "is too short", "maxLength": "is too long",
        }.get(kind)
        if problem is None:
            lines = [f"Invalid config at {where}: {_clip(error.message, 200)}"]
        else:
            lines = [f"Invalid config: {where} {problem}.",
                     f"  Found: {show(error.instance)} ({type_name(error.instance)})"]
        allowed = allowed_values(error.schema)
        if allowed:
            lines.append(f"  Allowed: {allowed}")
        lines += _about(where, error.schema)
    return lines[:MAX_PROBLEM_LINES]


def _unknown_keys(error: ValidationError, path: list) -> list[str]:
    known = list(error.schema.get("properties", {}))
    unknown = [key for key in error.instance if key not in known]
    level = key_path(path) if path else "the top level"
    lines = [f"Invalid config: unknown key{'s' if len(unknown) > 1 else ''} "
             f"{', '.join(key_path(path + [k]) for k in unknown)}."]
    guessed = False
    for key in unknown[:3]:
        close = difflib.get_close_matches(str(key), known, n=3, cutoff=0.6)
        if close:
            guessed = True
            lines.append(f"  Did you mean {' or '.join(key_path(path + [c]) for c in close)}"
                         f"{f' (for {key})' if len(unknown) > 1 else ''}?")
    listed = textwrap.wrap(f"Keys allowed at {level}: {', '.join(known)}", WIDTH,
                           initial_indent="  ", subsequent_indent="    ")
    # Few keys are listed; more only when no known name is near (up to four lines of them).
    if len(known) <= MAX_LISTED_KEYS or (not guessed and len(listed) <= 4):
        lines += listed
    elif not guessed:
        lines.append(f"  {len(known)} keys are allowed at {level}; none is close to this name.")
    return lines


def _about(where: str, schema: dict) -> list[str]:
    description = schema.get("description")
    prefix = f"  About {where}: "
    return [prefix + _first_sentence(description, WIDTH - len(prefix))] if description else []


def key_path(path: list) -> str:
    """`engine.max_num_seqs`, `captures[1].point`; the config itself is `the config`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out or "the config"


def type_name(value: Any) -> str:
    return next((name for kind, name in TYPE_NAMES if isinstance(value, kind)), type(value).__name__)


def show(value: Any) -> str:
    """A value as written in YAML's flow style (JSON), cut to a line."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return _clip(text, MAX_VALUE_CHARS)


def allowed_values(schema: dict) -> str:
    """What a key's schema allows, in words: `integer >= 1, or null`, `one of: cuda, cpu`."""
    if "enum" in schema:
        return "one of: " + ", ".join(v if isinstance(v, str) else show(v) for v in schema["enum"])
    if "const" in schema:
        return f"only {show(schema['const'])}"
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    words = []  # what the value must be beyond its type, e.g. ">= 1", "with exactly 2 items"
    bounds = [f"{op} {schema[key]}" for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"),
                                                      ("maximum", "<="), ("exclusiveMaximum", "<"))
              if key in schema]
    if bounds:
        words.append(" and ".join(bounds))
    if "pattern" in schema:
        words.append(f"matching the pattern {schema['pattern']}")
    if "minItems" in schema or "maxItems" in schema:
        low, high = schema.get("minItems"), schema.get("maxItems")
        words.append(f"with exactly {_items(low)}" if low == high
                     else " and ".join(x for x in (low is not None and f"with at least {_items(low)}",
                                                   high is not None and f"with at most {_items(high)}") if x))
    if "items" in schema and isinstance(schema["items"], dict) and "type" in schema["items"]:
        item_type = schema["items"]["type"]
        words.append(f"items of type {item_type if isinstance(item_type, str) else ' or '.join(item_type)}")
    main = [t for t in types if t != "null"]
    text = ", ".join(words)
    if main:
        text = " or ".join(main) + (f" {text}" if text else "")
    if "null" in types:
        text = f"{text}, or null" if text else "null"
    return text


def _items(n: int) -> str:
    return f"{n} item{'' if n == 1 else 's'}"


def _first_sentence(text: str, limit: int) -> str:
    """A description's first sentence, cut at a word to fit `limit` characters."""
    text = " ".join(str(text).split())
    end = text.find(". ")
    return _clip(text[: end + 1] if end > 0 else text, limit)


def _clip(text: str, limit: int) -> str:
    """`text`, or as many of its words as fit `limit` characters with "..."."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "..."
