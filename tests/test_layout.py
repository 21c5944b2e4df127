"""The library's rooms: every subpackage says what it is for, imports go one way only (the benchmarks
beside the library import it, never the reverse), and the module names that earlier datasets hold as
text still run."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
PACKAGE = SCRIPTS / "eagle3data"
BENCH = "eagle3bench"  # the benchmarks, a package beside the library
PACKAGES = (PACKAGE.name, BENCH)


def module_name(path: Path) -> str:
    parts = path.relative_to(SCRIPTS).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def imports() -> dict[str, set[str]]:
    """Each module's imports of the library and the benchmarks, as module names (a name imported from a
    package counts as the submodule where there is one). Build directories beside the sources are not
    modules."""
    modules = {module_name(p): p for name in PACKAGES for p in (SCRIPTS / name).rglob("*.py")
               if "build" not in p.relative_to(SCRIPTS).parts}
    found = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and ours(node.module):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if ours(a.name)}
        found[name] = targets
    return found


def room(module: str) -> str:
    """A subpackage of the library; the benchmarks are one room."""
    parts = module.split(".")
    if parts[0] == BENCH:
        return BENCH
    return parts[1] if len(parts) > 1 else ""


def test_every_subpackage_says_what_it_is_for():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.parent.name}/__init__.py: expected a docstring saying what the room is for"


def test_the_library_never_imports_the_benchmarks():
    """The installed package ships without the benchmarks, so no module of it may need them."""
    found = {module: sorted(t for t in targets if t.split(".")[0] == BENCH)
             for module, targets in imports().items() if module.split(".")[0] == PACKAGE.name}
    found = {module: targets for module, targets in found.items() if targets}
    assert not found, f"the library imports the benchmarks: {found}"


def test_no_import_circle_between_modules_or_rooms():
    graph = imports()
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        for target in targets:
            if room(module) and room(target) and room(module) != room(target):
                rooms.setdefault(room(module), set()).add(room(target))

    def circle(edges: dict[str, set[str]]) -> list[str] | None:
        state: dict[str, str] = {}

        def visit(node: str, path: list[str]) -> list[str] | None:
            state[node] = "open"
            for nxt in sorted(edges.get(node, ())):
                if state.get(nxt) == "open":
                    return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
                if nxt not in state and (found := visit(nxt, path + [node])):
                    return found
            state[node] = "done"
            return None

        for node in sorted(edges):
            if node not in state and (found := visit(node, [])):
                return found
        return None

    assert circle(graph) is None, f"modules import each other in a circle: {' -> '.join(circle(graph))}"
    assert circle(rooms) is None, f"rooms import each other in a circle: {' -> '.join(circle(rooms))}"
    # The floors: utilities and storage import no stage; contracts import only those two (the store's
    # compressed files are read through storage.compression).
    for low, allowed in {"utils": set(), "storage": {"utils"}, "contracts": {"utils", "storage"}}.items():
        assert rooms.get(low, set()) <= allowed, f"{low} imports {rooms[low] - allowed}: a lower floor above"
    # The stages before pack reach the store through its object (storage.store.Store), not the dataset's rooms.
    for stage in ("capture", "validate"):
        assert "dataset" not in rooms.get(stage, set()), f"{stage} imports dataset"


def test_the_export_commands_that_dataset_cards_name_still_run():
    for old, new in (("export_speculators", "exports.speculators"), ("export_specforge", "exports.specforge")):
        proc = subprocess.run([sys.executable, "-m", f"eagle3data.{old}", "--help"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "usage:" in proc.stdout and "dataset" in proc.stdout
        code = f"import eagle3data.{old} as a, eagle3data.{new} as b; assert a.main is b.main"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
