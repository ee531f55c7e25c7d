"""The hot path compiled to C with mypyc, used when it matches the source.

`make run` and `make test` compile the modules in HOT (the codec, the
request parser, the entries and the log, the peer messages, the native
engine's core and driver, forwarding, the service, the client protocols,
the request counters) with mypyc, which ships with mypy, into
`qserver/_compiled/` (not in git):

    python -m qserver.hotbuild build     # compile (needs a C compiler)
    python -m qserver.hotbuild ensure    # the same if a source changed (make)
    python -m qserver.hotbuild status    # what `import qserver` will use

Each compiled module is the same source turned into a C extension: the
same code, about a quarter fewer instructions per request on a replicating
master (bench/master_bench.py --instructions), and 1.1 to 1.3 times the
throughput of a three-node cluster (README, Performance). Compiled code
checks the annotated types where values cross into it (a callback typed
to return None must return None) and its classes' methods cannot be
replaced on an instance; the suite runs on it, and its tests of these
modules once more as Python (tests/test_compiled.py).

`import qserver` calls `install()`, which puts a finder first on
`sys.meta_path` that loads HOT's modules from the build, but only when
the build was made by this Python and every HOT source still hashes to
what was compiled: a module edited since (or a checkout of another
commit) runs as Python, all of HOT at once (compiled modules call each
other directly, so a mix could run stale code), which a node logs as a
warning when it starts (it logs which modules it runs in any case).
`QSERVER_PURE=1` in the environment runs pure Python on purpose; without a
build (no C compiler, say) it is pure Python too.

The store (state/store.py) is not compiled: compiled code keeps ints
unboxed and boxes them anew where it stores them, which costs a node
holding 1,000,000 messages some 90 MB (bench/memory_bench.py: 440 against
346 MB), where the interpreted store shares one int object between a
message's key, its FIFO slot and the messages produced with the same
times.

Importing it reads nothing; `install()` reads the manifest and hashes the
sources (about 300 KB, a millisecond) once per process.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = ["HOT", "GROUP", "BUILD_DIR", "install", "status", "active", "stale", "check", "build"]

# The modules compiled, as one mypyc group (one shared library).
HOT = (
    "qserver.wire.codec",
    "qserver.wire.requests",
    "qserver.state.entries",
    "qserver.state.log",
    "qserver.engines.messages",
    "qserver.engines.native.core",
    "qserver.engines.native.driver",
    "qserver.engines.forwarding",
    "qserver.service",
    "qserver.server",
    "qserver.stats",
)
GROUP = "qserver._hot"  # the shared library: qserver/_hot__mypyc.<suffix> in the build
PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_DIR = PACKAGE_DIR / "_compiled"
MANIFEST = BUILD_DIR / "manifest.json"
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]

# Why this process runs what it runs: COMPILED, or the reason it is Python.
COMPILED = "compiled"
NOT_CHECKED = "not checked"
NOT_BUILT = "not built"
PURE_SET = "QSERVER_PURE is set"
_reason = NOT_CHECKED


def _source(module: str) -> Path:
    return PACKAGE_DIR.parent.joinpath(*module.split(".")).with_suffix(".py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _binary(module: str) -> Path:
    return BUILD_DIR.joinpath(*module.split(".")).with_name(
        module.rsplit(".", 1)[-1] + SUFFIX)


def check() -> str | None:
    """Why the build cannot be used, or None if it can."""
    try:
        manifest = json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        return NOT_BUILT
    except (OSError, ValueError) as exc:
        return f"unreadable manifest {MANIFEST}: {exc}"
    if manifest.get("suffix") != SUFFIX or manifest.get("hexversion") != sys.hexversion:
        return f"built by another Python ({manifest.get('version')})"
    sources = manifest.get("sources", {})
    if sorted(sources) != sorted(HOT):
        return "built for another module list"
    for module in HOT:
        try:
            if _digest(_source(module)) != sources[module]:
                return f"{_source(module).relative_to(PACKAGE_DIR.parent)} changed since the build"
        except OSError as exc:
            return str(exc)
    for module in (*HOT, GROUP + "__mypyc"):
        if not _binary(module).is_file():
            return f"{_binary(module)} missing"
    return None


class _Finder(importlib.abc.MetaPathFinder):
    """Loads HOT's modules (and their shared library) from the build."""

    def __init__(self) -> None:
        self.names = {*HOT, GROUP + "__mypyc"}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        location = str(_binary(fullname))
        return importlib.util.spec_from_file_location(
            fullname, location, loader=importlib.machinery.ExtensionFileLoader(fullname, location))


def install() -> bool:
    """Use the compiled modules if they match the source (see the module
    docstring); True if they will be used. Called by `import qserver`,
    before any HOT module is imported; once."""
    global _reason
    if _reason != NOT_CHECKED:
        return _reason == COMPILED
    if os.environ.get("QSERVER_PURE", "") not in ("", "0"):
        reason: str | None = PURE_SET
    elif already := [m for m in HOT if m in sys.modules]:
        reason = f"{already[0]} was imported first"
    else:
        reason = check()
    if reason is None:
        sys.meta_path.insert(0, _Finder())
        _reason = COMPILED
        return True
    _reason = reason
    return False


def active() -> bool:
    """Whether this process runs the compiled modules."""
    return _reason == COMPILED


def status() -> str:
    """What this process runs, in a line (a node logs it as it starts)."""
    if _reason == COMPILED:
        return f"compiled ({len(HOT)} modules, mypyc)"
    if stale():
        return (f"pure Python ({_reason}; `python -m qserver.hotbuild build` "
                f"or make compiles it again)")
    return f"pure Python ({_reason})"


def stale() -> bool:
    """Whether there is a build this process does not use because it does
    not match (a node logs that as a warning)."""
    return _reason not in (COMPILED, NOT_BUILT, PURE_SET, NOT_CHECKED)


def build(quiet: bool = False) -> int:
    """Compile HOT into BUILD_DIR; 0 on success. Needs mypy (mypyc) and a C
    compiler; the build is written aside and moved into place whole, with
    its manifest last."""
    import shutil
    import tempfile

    from mypyc.build import mypycify
    from setuptools import Distribution  # type: ignore[import-untyped]

    root = PACKAGE_DIR.parent
    digests = {module: _digest(_source(module)) for module in HOT}
    work = Path(tempfile.mkdtemp(prefix="qserver-compile-"))
    cwd = os.getcwd()
    try:
        os.chdir(root)  # mypy names the modules from the paths it is given
        paths = [str(_source(m).relative_to(root)) for m in HOT]
        extensions = mypycify([*paths, "--no-warn-unused-configs"], group_name=GROUP,
                              target_dir=str(work / "c"), opt_level="3")
        dist = Distribution({"name": "qserver-compiled", "ext_modules": extensions})
        dist.script_args = ["build_ext", "--build-lib", str(work / "lib"),
                            "--build-temp", str(work / "temp")] + (["--quiet"] if quiet else [])
        dist.parse_command_line()
        dist.run_commands()
        staged = work / "staged"
        for module in (*HOT, GROUP + "__mypyc"):
            parts = module.split(".")
            built = work.joinpath("lib", *parts[:-1], parts[-1] + SUFFIX)
            target = staged.joinpath(*parts[:-1], parts[-1] + SUFFIX)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, target)
        (staged / "manifest.json").write_text(json.dumps({
            "suffix": SUFFIX, "hexversion": sys.hexversion, "version": sys.version,
            "sources": digests}, indent=1, sort_keys=True))
        (staged / ".gitignore").write_text("*\n")
        old = BUILD_DIR.with_name("_compiled.old")
        shutil.rmtree(old, ignore_errors=True)
        if BUILD_DIR.exists():
            BUILD_DIR.rename(old)
        staged.rename(BUILD_DIR)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.chdir(cwd)
        shutil.rmtree(work, ignore_errors=True)
    if [m for m in HOT if _digest(_source(m)) != digests[m]]:
        print("qserver: a source changed during the build; build again", file=sys.stderr)
        return 1
    return 0
