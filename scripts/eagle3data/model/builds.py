"""Which model directories the pipeline may write: only those it built itself, marked as such.

Rules `demo_model` and `gguf_model` write a whole checkpoint directory at `model.path`. Snakemake removes
a rule's `directory()` output before it runs the rule again (an input newer than the output is enough),
so pointed at a user's checkpoint, a builder would delete it. Each builder therefore writes a marker
file inside what it builds, and the workflow refuses, before any job runs (eagle3data.config.run_check), a `model.path` that holds
anything without that marker.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from eagle3data.utils.problems import Problem
from eagle3data.storage.store import atomic_path

MARKER = ".eagle3data-built.json"


@contextlib.contextmanager
def building(out_dir: Path, builder: str, source: str) -> Iterator[Path]:
    """A temporary directory beside `out_dir` to build the model in; renamed into place, with the
    marker naming `builder` and `source`, only if the block succeeds."""
    with atomic_path(out_dir) as tmp:
        tmp = Path(tmp)
        tmp.mkdir()
        yield tmp
        (tmp / MARKER).write_text(json.dumps({"builder": builder, "source": source}) + "\n")


def buildable_problem(path: str | Path, builder: str) -> Problem | None:
    """Why `path` may not be a builder's output (it is not absent, empty, or built by the pipeline), or None."""
    path = Path(path)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    if (path / MARKER).is_file():
        return None
    found = "is a file" if not path.is_dir() else f"holds {sum(1 for _ in path.iterdir())} entries and no {MARKER}"
    return Problem("model.path", f"{path} {found}: this pipeline did not build it, and rule {builder} would "
                   "replace it.", "a new or empty directory for the built model, or no builder key",
                   "remove model.build_demo / model.from_gguf to use the checkpoint there as it is, or point "
                   "model.path at a new directory for the built model.")
