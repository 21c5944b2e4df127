"""What our connector relies on of vLLM's example hidden-states connector (no public API), checked against
the installed vLLM: a release that renames or drops a member fails here, naming it and the version the
adapter (capture/vllm_surface.py) was tested with, and not in a capture run.

The names are read from the adapter's and the connector's source, so a member used there is checked
without a list to keep up to date.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

from eagle3data.engine.start import TESTED_VLLM, installed_vllm

CAPTURE = Path(__file__).resolve().parents[1] / "scripts" / "eagle3data" / "capture"
STOCK_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def versions() -> str:
    dist, version = installed_vllm()
    return f"{dist} {version} is installed; capture/vllm_surface.py was tested with {dist} {TESTED_VLLM[dist]}"


def class_node(path: Path, name: str) -> ast.ClassDef:
    return next(node for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ClassDef) and node.name == name)


def read_on(node: ast.AST, name: str) -> set[str]:
    """The attributes read or set on the variable `name` within `node`."""
    return {n.attr for n in ast.walk(node)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name}


def own(node: ast.ClassDef) -> set[str]:
    """What a class of ours defines: its methods and the attributes it assigns to `self`."""
    targets = [t for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    assigned = {e.attr for t in targets for e in ast.walk(t)
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"}
    return assigned | {n.name for n in node.body if isinstance(n, ast.FunctionDef)}


def members(cls: type) -> set[str]:
    """A vLLM class's members: its attributes and those its methods assign to `self` (the instance's)."""
    assigned = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("vllm"):
            assigned |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(klass)))
    return set(dir(cls)) | assigned


def stock():
    return importlib.import_module(STOCK_MODULE)


def test_the_installed_vllm_has_every_name_the_adapter_imports():
    missing = []
    for node in ast.walk(ast.parse((CAPTURE / "vllm_surface.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module.startswith("vllm"):
            try:
                module = importlib.import_module(node.module)
            except ImportError as exc:
                missing.append(f"the module {node.module} ({exc})")
                continue
            missing += [f"{node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert not missing, f"{versions()}, and this vLLM lacks {', '.join(missing)}"


def test_the_installed_vllm_connector_has_every_member_the_adapter_uses():
    adapter = class_node(CAPTURE / "vllm_surface.py", "StockConnector")
    hooks = {n.name for n in adapter.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
    used = {"ExampleHiddenStatesConnector": (read_on(adapter, "self") - own(adapter)) | hooks,
            "PendingSave": read_on(ast.parse((CAPTURE / "vllm_surface.py").read_text()), "pending"),
            "ExampleHiddenStatesConnectorMetadata": read_on(adapter, "metadata")}
    assert all(used.values()), f"no use found in vllm_surface.py of {[k for k, v in used.items() if not v]}"
    missing = []
    for name, needed in used.items():
        cls = getattr(stock(), name)
        found = members(cls) | {f.name for f in (dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ())}
        missing += [f"{name}.{member}" for member in sorted(needed - found)]
    assert not missing, f"{versions()}, and this vLLM lacks {', '.join(missing)}: rename them in vllm_surface.py"


def test_the_connector_overrides_only_hooks_that_exist_and_names_its_own_members_apart():
    from eagle3data.capture.vllm_surface import StockConnector

    connector = class_node(CAPTURE / "connector.py", "Eagle3StatesConnector")
    vllm_members, ours = members(stock().ExampleHiddenStatesConnector), own(connector)
    dangling = sorted(n for n in ours if not n.startswith("_") and n not in members(StockConnector))
    assert not dangling, (f"{versions()}; connector.py overrides {dangling}, which vLLM's connector does not "
                          "have (never called)")
    clashing = sorted(n for n in ours if n.startswith("_") and n in vllm_members)
    assert not clashing, (f"{versions()}; connector.py's own {clashing} replace vLLM's members of those names: "
                          "rename them, or reach vLLM's through vllm_surface.py")
    reached = sorted(n for n in read_on(connector, "self") - ours if n.startswith("_"))
    assert not reached, f"connector.py reaches vLLM's private {reached}: name them in vllm_surface.py"
