"""Problems found before any job runs, told in a screen: where, what was found, what is allowed, what to do.

A run that would fail on its first GPU job (a model.path that is no checkpoint, a capture beyond the
model's layers, a sequence longer than its context, a broken input line) should fail while Snakemake
plans it, in seconds, saying so in a few lines. Every check returns `Problem`s instead of raising, so
a config's problems are all told at once; `stop_on` prints them and exits before any job starts.
Set EAGLE3DATA_DEBUG=1 to get a traceback instead (Snakemake's own report of the exception).
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field

DEBUG_ENV = "EAGLE3DATA_DEBUG"
MAX_PROBLEM_LINES = 8  # one problem's lines; a header and a footer make at most 10 for one problem
WIDTH = 100  # characters of a line on screen; longer lines wrap, indented
HELP = "Each message and what to do: docs/troubleshooting.md; every key: docs/configuration.md."


@dataclass(frozen=True)
class Problem:
    """One mistake: `where` (a config key, or file:line), what was `found`, what is `allowed`, and what
    to `do`. `lines` replaces found/allowed/do where a check words its message itself (the schema's)."""

    where: str
    found: str = ""
    allowed: str = ""
    do: str = ""
    lines: tuple[str, ...] = field(default=())

    def text(self) -> list[str]:
        """The problem's lines on screen, wrapped at WIDTH, at most MAX_PROBLEM_LINES."""
        lines = list(self.lines) or [f"{self.where}: {self.found}",
                                     *([f"  Allowed: {self.allowed}"] if self.allowed else []),
                                     *([f"  Do: {self.do}"] if self.do else [])]
        out = []
        for line in lines:
            indent = " " * (len(line) - len(line.lstrip()) + 4)
            out += textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_long_words=False,
                                 break_on_hyphens=False) or [""]
        return out[:MAX_PROBLEM_LINES]


class RunProblems(ValueError):
    """A run's problems, raised where EAGLE3DATA_DEBUG asks for a traceback; the message is `render`'s."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__(render(problems))


def render(problems: list[Problem], what: str = "this run") -> str:
    """The problems as the screen shows them: a count, each problem, where to read more."""
    n = len(problems)
    lines = [f"eagle3-datagen: {n} problem{'s' if n > 1 else ''} in {what}, found before any GPU job:"]
    for problem in problems:
        lines += problem.text()
    lines.append(HELP)
    return "\n".join(lines)


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def stop_on(problems: Iterable[Problem], what: str = "this run") -> None:
    """Print the problems and exit with status 1 (no traceback), or raise RunProblems under
    EAGLE3DATA_DEBUG=1; do nothing when there are none."""
    problems = list(problems)
    if not problems:
        return
    if debug():
        raise RunProblems(problems)
    print(render(problems, what), file=sys.stderr, flush=True)
    raise SystemExit(1)
