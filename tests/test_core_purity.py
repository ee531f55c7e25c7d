"""The deterministic core never imports I/O, clocks, randomness or threads
(style.md: "The core has no I/O"). Checked by inspecting every import."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "qserver"

CORE_NAMES = [
    "qserver.state.store", "qserver.state.entries", "qserver.state.log", "qserver.wire.requests", "qserver.wire.codec",
    "qserver.service", "qserver.engines.base", "qserver.engines.local",
    "qserver.engines.native.core", "qserver.engines.messages", "qserver.engines.raft.machine",
    "qserver.storage.format",
]
CORE_MODULES = [str(Path(*n.split(".")[1:])) + ".py" for n in CORE_NAMES]

FORBIDDEN = {"asyncio", "socket", "os", "time", "random", "threading", "pathlib",
             "subprocess", "selectors", "signal", "uvloop", "io", "shutil", "tempfile"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
            names.add("__import__")
    return names


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_module_has_no_io_imports(module):
    bad = imported_modules(PKG / module) & (FORBIDDEN | {"__import__"})
    assert not bad, f"{module} imports {sorted(bad)}"


def test_core_relative_imports_stay_in_core():
    """A core module may import only other core modules of the package (and
    config/errors, which hold plain values)."""
    allowed = {Path(m).stem for m in CORE_MODULES} | {"config", "errors", "base"}
    for module in CORE_MODULES:
        tree = ast.parse((PKG / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module:
                leaf = node.module.split(".")[-1]
                assert leaf in allowed, f"{module} imports .{node.module}"


def test_forbidden_list_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom os import path\n")
    assert imported_modules(bad) == {"time", "os"}
