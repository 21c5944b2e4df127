"""The documentation is a product's: generated parts are current, links resolve, and no file of the
project carries its history (work sessions, issue numbers, dates outside the measurements) or the
absolute paths of a machine.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from eagle3bench import table
from eagle3data.config import reference
from eagle3data.inputs.conversations import normalize

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]

_ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
             "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth thirtieth").split()
_SESSION = "session"
HISTORY = {
    "a work session": re.compile(
        r"\b(?:(?:twenty|thirty)-)?(?:" + "|".join(_ORDINALS) + r")\s+" + _SESSION
        + r"|\b" + _SESSION + r"\s?\d+"
        + r"|\b(?:this|that|next|previous|last|earlier|later|GPU|work|device)\s+" + _SESSION + r"s?\b"
        + r"|(?<![\w.])s\d{1,2}-(?=[a-z])", re.I),
    "an issue number": re.compile(r"\bissues?\s+#?\d+|(?<![\w\]\[&/])#\d+\b", re.I),
    "a date": re.compile(r"(?<!measurements/)\b20\d\d-[01]\d-[0-3]\d\b"),
    "a removed page": re.compile(r"docs/(?:rerun|gpu-run)\.md"),
}
MACHINE_PATH = re.compile(r"(?<![\w.~$}-])/(?:work|home)/")  # in any file
MACHINE_PATH_DOCS = re.compile(r"(?<![\w.~$}-])/(?:work|home|root|tmp)/")  # in the documentation

def project_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    files = []
    for name in filter(None, out):
        path = REPO / name
        if (name.startswith("docs/measurements/") or name == "tests/test_docs.py" or not path.is_file()):
            continue
        files.append(path)
    return files


def generated_lines(text: str) -> set[int]:
    """Line numbers (1-based) inside the generated results tables: measurement rows, dates allowed."""
    inside, lines = False, set()
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith(table.BEGIN):
            inside = True
        elif line.startswith(table.END):
            inside = False
        elif inside:
            lines.add(n)
    return lines


def hits(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    rel = path.relative_to(REPO).as_posix()
    measurement_rows = generated_lines(text)
    paths = MACHINE_PATH_DOCS if path.suffix == ".md" else MACHINE_PATH
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in HISTORY.items():
            if what == "a date" and n in measurement_rows:
                continue
            if pattern.search(line):
                found.append(f"{rel}:{n}: {what}: {line.strip()[:100]}")
        if paths.search(line):
            found.append(f"{rel}:{n}: an absolute machine path: {line.strip()[:100]}")
    return found


def test_no_history_and_no_machine_paths_in_the_project():
    found = [hit for path in project_files() for hit in hits(path)]
    assert not found, "history or machine paths (write what is, not when or by whom):\n" + "\n".join(found)


def test_the_grep_finds_what_it_must():
    samples = {
        "the twenty-fifth " + _SESSION + " measured it": "a work session",
        "see " + _SESSION + "4 for details": "a work session",
        "docs/measurements/2026-12-04-h200-s25-x.json": "a work session",
        "as issue 45 asks": "an issue number",
        "fixed in #45": "an issue number",
        "measured 2026-12-01 on the H200": "a date",
        "see docs/rerun.md": "a removed page",
    }
    for line, what in samples.items():
        assert HISTORY[what].search(line), line
    assert MACHINE_PATH_DOCS.search("python x.py --model /tmp/llama")
    assert MACHINE_PATH.search("flags from /work/shared/notes")
    for line in ("a session of its own (os.setsid)", '@pytest.fixture(scope="session")', "EAGLE3DATA_FAULTS=kill@extract:batch_done#2",
                 "docs/measurements/2026-12-01-h200-figure1-default.json", "/dev/shm/eagle3data"):
        assert not any(p.search(line) for p in HISTORY.values()), line
        assert not MACHINE_PATH_DOCS.search(line), line


def test_configuration_reference_is_generated_and_current():
    assert reference.PAGE.read_text() == reference.page(), (
        "docs/configuration.md differs from config/schema.yaml: run python -m eagle3data.config.reference")


def test_benchmark_tables_are_generated_and_current():
    assert table.stale() == [], "run python -m eagle3bench.table"


def test_every_measurement_file_is_indexed():
    indexed = {row.file for row in table.read_index()}
    files = {p.name for p in table.MEASUREMENTS.iterdir() if re.search(r"\.json(\.gz)?$", p.name)}
    with_figures = {name for name in files if table.figures_of(table.load(table.MEASUREMENTS / name))}
    assert with_figures == indexed
    assert not [name for name in files if re.search(r"session|-s\d+-", name)]


def test_readme_is_a_router_that_keeps_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "bash envs/setup.sh && .venv/bin/snakemake && .venv/bin/snakemake --report results/demo/report.html" in text
    assert "bash .ci/slurm.sh install && .venv/bin/python -m pytest" in text
    assert len((REPO / "docs" / "benchmarks.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target:
            continue
        if not (page.parent / target).exists():
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files: {broken}"


@pytest.mark.parametrize("page", ["README.md", "docs/input-formats.md"])
def test_literal_rows_in_the_docs_are_accepted(page):
    text = (REPO / page).read_text()
    rows = [line for block in re.findall(r"```\n(\{.*?)```", text, re.S) for line in block.strip().splitlines()]
    assert rows
    for line in rows:
        conversation = normalize(json.loads(line))
        assert any(m["role"] == "assistant" for m in conversation.messages), line


def _walk() -> str:
    text = (REPO / "docs" / "training.md").read_text()
    return text.split("## From the dataset to a served draft", 1)[1].split("\n## ", 1)[0]


def _command(walk: str, module: str) -> list[str]:
    block = next(b for b in re.findall(r"```[a-z]*\n(.*?)```", walk, re.S) if f"-m {module} " in b)
    return block.replace("\\\n", " ").split()


def test_the_walk_to_a_served_draft_uses_the_acceptance_benchmarks_commands():
    """docs/training.md's walk runs what `eagle3bench.acceptance` runs (tests/test_acceptance.py runs
    that): its training flags are the quick recipe's, its speculative config acceptance_serve's, and the
    modules it names are the ones the benchmark starts."""
    import inspect

    from eagle3bench import acceptance, acceptance_data, acceptance_serve, acceptance_train

    walk = _walk()
    recipe = acceptance_train.SIZES["quick"].recipe
    train = _command(walk, "eagle3bench.speculators_cpu")
    flags = recipe.flags()
    for i in range(0, len(flags)):  # every flag of the recipe, with the values that follow it
        if flags[i].startswith("--"):
            values = []
            for v in flags[i + 1:]:
                if v.startswith("--"):
                    break
                values.append(v)
            at = train.index(flags[i])
            assert [float(x) if re.fullmatch(r"[\d.e-]+", x) else x for x in train[at + 1:at + 1 + len(values)]] == \
                [float(x) if re.fullmatch(r"[\d.e-]+", x) else x for x in values], flags[i]
    assert "eagle3bench.speculators_cpu" in inspect.getsource(acceptance_train.train)
    assert " ".join(map(str, acceptance_data.LAYER_IDS)) in " ".join(train)
    assert f"draft_vocab_size: {recipe.draft_vocab}" in walk
    config = acceptance_data.pipeline_config("x", Path("c.jsonl"), Path("m"), recipe.draft_vocab)
    assert "speculators: {enabled: true, states: files}" in walk and config["export"]["speculators"] == \
        {"enabled": True, "states": "files"}
    assert f'"num_speculative_tokens": {acceptance_serve.SPECULATIVE_TOKENS}' in walk
    assert '"method": "eagle3"' in walk and '"method": "eagle3"' in inspect.getsource(acceptance_serve.serve)
    serve = _command(walk, "eagle3bench.acceptance_serve")
    assert "eagle3bench.acceptance_serve" in inspect.getsource(acceptance.serve)
    for flag in ("--model", "--prompts", "--draft", "--max-tokens", "--out"):
        assert flag in serve and flag in inspect.getsource(acceptance_serve.main), flag
    assert f"--max-tokens {acceptance_train.SIZES['quick'].max_tokens}" in " ".join(serve)
    assert "mean_acceptance_length" in walk and "mean_acceptance_length" in inspect.getsource(acceptance_serve)
    built = yaml.safe_load((REPO / "config" / "smollm2.yaml").read_text())["model"]["path"]
    assert acceptance.DEFAULT_MODEL == built and f"`{built}`" in walk and "config/smollm2.yaml" in walk


# The user pages: benchmark vocabulary (figure numbers, arm letters) stays in benchmarks.md.
USER_PAGES = ["README.md", "docs/configuration.md", "docs/output-format.md", "docs/training.md", "docs/resume.md",
              "docs/regeneration.md", "docs/troubleshooting.md", "docs/input-formats.md", "docs/expectations.md",
              "docs/slurm.md"]
DECIMAL = re.compile(r"(?<![\w.=-])~?\d+\.\d+(?:-\d+\.\d+)?x?(?![\w.])")
# Decimals a user page may state outside a generated quote: none of them comes from docs/measurements/.
NOT_MEASUREMENTS = {
    "versions": {"0.2", "0.9", "3.11", "2.11", "2.6", "0.26"},
    "the parity gate's tolerances and the bf16 floor they were set from (config/schema.yaml, tests/test_parity.py)":
        {"0.002-0.013", "0.005-0.05", "0.011-0.10", "0.10", "0.1", "1.0", "0.22", "0.36", "2.3"},
    "the exports' bound that tests/test_trainers.py holds": {"0.1x"},
    "the input scan's rate, stated where it is measured (inputs/scan.py)": {"2.5", "1.3"},
}


def prose(text: str) -> str:
    """A page without its code, generated tables, generated quotes and inline code."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(re.escape(table.BEGIN) + ".*?" + re.escape(table.END), "", text, flags=re.S)
    text = table.QUOTE.sub("", text)
    return re.sub(r"`[^`]*`", "", text)


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_pages_quote_measurements_only_as_generated(page):
    """Every number a user page quotes from a measurement is generated from it (between the quote markers,
    kept current by eagle3bench.table, the test above), and no user page speaks in figure numbers."""
    text = prose((REPO / page).read_text())
    allowed = set().union(*NOT_MEASUREMENTS.values())
    stray = sorted(set(DECIMAL.findall(text)) - allowed)
    assert not stray, f"{page}: numbers not generated from docs/measurements/ (quote them): {stray}"
    figures = re.findall(r"\bfigures? \d+[a-z]?\b|\barm \([a-e]\)|\b\d+[dtw]\b(?= |,|\))", text)
    assert not figures, f"{page}: benchmark vocabulary in a user page (use plain names): {figures}"


def test_every_quote_names_what_it_quotes():
    names = {m.group(2) for page in [*DOCS] for m in table.QUOTE.finditer(page.read_text())}
    assert names and names <= set(table.QUOTES)
