"""The deterministic core does no I/O (style.md: "The core has no I/O").

The core is found, not listed: every module under qserver/wire/ and
qserver/state/, and every module of the package whose docstring says "This
module does no I/O." (a new pure module is checked once it says so). Each
core module is read as source, never imported, and must not:

- import I/O, clocks, randomness, threads or logging (FORBIDDEN_IMPORTS);
- call open, print, input, exec, eval or __import__ (FORBIDDEN_CALLS);
- import a module of the package outside the core, except config and
  errors, which hold plain values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "qserver"
MARKER = "This module does no I/O."
CORE_DIRS = ("wire", "state")  # every module under these is core
ALLOWED_OUTSIDE = {"qserver.config", "qserver.errors"}

FORBIDDEN_IMPORTS = {"asyncio", "socket", "os", "time", "random", "threading", "pathlib",
                     "subprocess", "selectors", "signal", "uvloop", "io", "shutil", "tempfile",
                     "logging"}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def module_name(path: Path, pkg: Path = PKG) -> str:
    """The dotted name of the module at `path` in the package at `pkg`."""
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def find_core(pkg: Path = PKG) -> dict[str, Path]:
    """The core modules of the package at `pkg`, by dotted name."""
    core = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg)
        in_core_dir = len(rel.parts) > 1 and rel.parts[0] in CORE_DIRS
        if in_core_dir or MARKER in (ast.get_docstring(parse(path)) or ""):
            core[module_name(path, pkg)] = path
    return core


def io_imports(tree: ast.Module) -> set[str]:
    """The forbidden top-level modules that `tree` imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & FORBIDDEN_IMPORTS


def forbidden_calls(tree: ast.Module) -> set[str]:
    """The forbidden builtins that `tree` calls by name."""
    return {node.func.id for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in FORBIDDEN_CALLS}


def _is_module(name: str, pkg: Path) -> bool:
    path = pkg.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_imports(tree: ast.Module, module: str, is_package: bool,
                    pkg: Path = PKG) -> set[str]:
    """The modules of the package (by dotted name) that `tree`, the source of
    `module`, imports, relative imports resolved; TYPE_CHECKING ones too."""
    top = pkg.name
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == top)
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            if not node.module or node.module.split(".")[0] != top:
                continue
            base = node.module
        else:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:  # `from . import x` may name a module
            sub = f"{base}.{alias.name}"
            found.add(sub if _is_module(sub, pkg) else base)
    return found


CORE = find_core()


def test_the_core_is_found_by_folder_and_by_marker():
    assert any(name.startswith("qserver.wire.") for name in CORE)
    assert any(name.startswith("qserver.state.") for name in CORE)
    # The engines' pure parts (native/core.py, raft/machine.py) carry the
    # marker; losing it must be noticed.
    for engine in ("native", "raft"):
        assert any(name.startswith(f"qserver.engines.{engine}.") for name in CORE), \
            f"no module under qserver/engines/{engine}/ says {MARKER!r} in its docstring"


def strict_mypy_modules() -> list[str]:
    """The module patterns pyproject.toml gives mypy's strict flags."""
    import tomllib

    config = tomllib.loads((PKG.parent / "pyproject.toml").read_text())
    for override in config["tool"]["mypy"]["overrides"]:
        if override.get("disallow_untyped_defs"):
            return list(override["module"])
    raise AssertionError("pyproject.toml gives no module mypy's strict flags")


def test_the_core_is_what_mypy_checks_strictly():
    """The two lists of the core cannot drift apart: a module that loses its
    marker (and so these checks) still named in pyproject fails here, and
    so does a new pure module that mypy does not check strictly."""
    core = set(find_core())
    patterns = strict_mypy_modules()

    def matches(name: str, pattern: str) -> bool:
        # mypy: "a.*" matches the package a and every module below it
        if pattern.endswith(".*"):
            return name == pattern[:-2] or name.startswith(pattern[:-1])
        return name == pattern

    assert sorted(n for n in core if not any(matches(n, p) for p in patterns)) == []
    for pattern in patterns:
        assert any(matches(n, pattern) for n in core), \
            f"{pattern} (strict for mypy) is not in the core"


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_module_does_no_io(module):
    tree = parse(CORE[module])
    assert not io_imports(tree), f"{module} imports {sorted(io_imports(tree))}"
    assert not forbidden_calls(tree), f"{module} calls {sorted(forbidden_calls(tree))}"


@pytest.mark.parametrize("module", sorted(CORE))
def test_core_imports_stay_in_the_core(module):
    path = CORE[module]
    imported = package_imports(parse(path), module, path.name == "__init__.py")
    outside = sorted(m for m in imported if m not in CORE and m not in ALLOWED_OUTSIDE)
    assert not outside, f"{module} imports {outside}"


def test_the_checks_catch_violations(tmp_path):
    pkg = tmp_path / "qserver"
    (pkg / "wire").mkdir(parents=True)
    (pkg / "engines").mkdir()
    for init in (pkg, pkg / "wire", pkg / "engines"):
        (init / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "engines" / "driver.py").write_text("import asyncio\n")
    (pkg / "wire" / "codec.py").write_text('"""Framing."""\n')
    (pkg / "engines" / "pure.py").write_text(f'"""Pure.\n\n{MARKER}\n"""\n')
    (pkg / "engines" / "other.py").write_text('"""Does I/O."""\n')
    assert set(find_core(pkg)) == {"qserver.wire", "qserver.wire.codec", "qserver.engines.pure"}

    bad = ast.parse("import time\nimport logging.handlers\nfrom os import path\n"
                    "import collections\nfrom . import x\n"
                    "open('f')\nprint(1)\n__import__('socket')\neval('1')\n"
                    "self.open()\nlog.print()\n")
    assert io_imports(bad) == {"time", "logging", "os"}
    assert forbidden_calls(bad) == {"open", "print", "__import__", "eval"}

    source = ast.parse("from . import driver, pure\nfrom .driver import Engine\n"
                       "from ..errors import QServerError\nimport qserver.wire.codec\n"
                       "from qserver.wire import codec\n")
    assert package_imports(source, "qserver.engines.pure", False, pkg) == {
        "qserver.engines.driver", "qserver.engines.pure", "qserver.errors",
        "qserver.wire.codec"}
