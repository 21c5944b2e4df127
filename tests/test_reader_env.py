"""A trainer's environment reads the dataset with this package and requirements-reader.txt alone.

An environment is built of exactly those distributions, their own dependencies (as their metadata
declares them) and what the trainers bring (torch, hs-connectors), linked from this one's site-packages:
nothing else is importable, and the package is a copy of what its wheel holds (no config/ beside it).
There, `open_dataset` reads and verifies the demo's rows and both trainers' readers import.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

from conftest import REPO

TRAINERS_BRING = ["torch", "hs-connectors"]


def requirements() -> list[str]:
    lines = (REPO / "requirements-reader.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def closure(names: list[str]) -> set[str]:
    """The distributions `names` need, theirs included (markers evaluated without extras)."""
    seen, todo = set(), [Requirement(n).name for n in names]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def link_distribution(name: str, site: Path) -> None:
    """The distribution's top-level files and directories, and its metadata, linked into `site`."""
    dist = metadata.distribution(name)
    root = Path(dist.locate_file(""))
    for top in {Path(f).parts[0] for f in dist.files or []}:
        source, target = root / top, site / top
        if source.exists() and not target.exists() and not top.startswith(".."):
            target.symlink_to(source)


def test_the_reader_requirements_read_a_dataset_in_a_trainers_environment(demo_run, tmp_path):
    for line in requirements():
        assert re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", line), f"requirements-reader.txt: pin {line!r}"
        name, version = line.split("==")
        assert metadata.version(name) == version, f"{name}: tested with {metadata.version(name)}, pinned {version}"
    env = tmp_path / "trainer-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    site = env / Path(sysconfig.get_path("purelib")).relative_to(sysconfig.get_path("data"))
    for name in closure(requirements() + TRAINERS_BRING):
        link_distribution(name, site)
    shutil.copytree(REPO / "scripts" / "eagle3data", site / "eagle3data")  # what `pip install --no-deps .` puts there
    dataset = demo_run / "results" / "demo" / "dataset"
    code = (
        "import sys; from eagle3data import open_dataset\n"
        f"ds = open_dataset({str(dataset)!r})\n"
        "rows = [row for row in ds]\n"
        "assert len(rows) == len(ds) > 0 and rows[0]['hidden_states'].ndim == 3\n"
        "import eagle3data.exports.speculators_reader, eagle3data.exports.specforge_reader\n"
        "for banned in ('snakemake', 'vllm', 'transformers', 'matplotlib'):\n"
        "    assert banned not in sys.modules, banned\n"
        "print('read', len(rows))\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    proc = subprocess.run([str(env / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=300,
                          env=clean, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("read ")
