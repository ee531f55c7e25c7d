"""The compiled hot path (qserver/compiled.py): used when the build matches
the source, and only then; the pure-Python modules pass the same tests.

The suite itself runs on whatever `import qserver` chose (the compiled
modules after `make test` on a machine with a C compiler); the last test
here runs the tests of the compiled modules' behaviour once more on the
pure-Python modules (QSERVER_PURE=1), so that both stay correct: a machine
without a compiler, and a checkout edited since its build, run those."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qserver import compiled

REPO = Path(__file__).resolve().parent.parent
PROBE = ("import sys, qserver, qserver.service as s; "
         "print(qserver.compiled.status()); print(s.__file__)")


def _probe(tree: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`import qserver` in a fresh interpreter from `tree` (a copy of the
    package), with `env` added to the environment."""
    environment = {k: v for k, v in os.environ.items() if k != "QSERVER_PURE"}
    environment.update(env, PYTHONPATH=str(tree))
    return subprocess.run([sys.executable, "-c", PROBE], cwd=tree, env=environment,
                          capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture
def built_copy(tmp_path: Path) -> Path:
    """A copy of the package with its build, where a source may be edited."""
    if compiled.check() is not None:
        pytest.skip(f"no usable build here: {compiled.check()}")
    shutil.copytree(REPO / "qserver", tmp_path / "qserver",
                    ignore=shutil.ignore_patterns("__pycache__", "_compiled.old"))
    return tmp_path


def test_the_hot_modules_are_the_build_when_it_matches_the_source():
    if compiled.check() is not None:
        pytest.skip(f"no usable build here: {compiled.check()}")
    if os.environ.get("QSERVER_PURE", "") not in ("", "0"):
        pytest.skip("QSERVER_PURE is set")
    assert compiled.active()
    for name in compiled.HOT:
        module = importlib.import_module(name)
        assert module.__file__ is not None
        assert Path(module.__file__).is_relative_to(compiled.BUILD_DIR), name
        assert module.__file__.endswith(compiled.SUFFIX), name
    assert importlib.import_module("qserver.state.store").__file__.endswith(".py")


def test_a_build_is_used_only_while_every_source_matches_it(built_copy: Path):
    fresh = _probe(built_copy)
    status, service_file = fresh.stdout.splitlines()
    assert status.startswith("compiled"), fresh
    assert service_file.endswith(compiled.SUFFIX) and fresh.stderr == ""

    # One source edited: every hot module runs as Python, and the status
    # (which a node logs as a warning) says why.
    source = built_copy / "qserver" / "engines" / "native" / "core.py"
    source.write_text(source.read_text() + "\n# edited\n")
    stale = _probe(built_copy)
    status, service_file = stale.stdout.splitlines()
    assert status.startswith("pure Python (qserver/engines/native/core.py changed since the "
                             "build; `python -m qserver.hotbuild build`"), status
    assert service_file == str(built_copy / "qserver" / "service.py")
    assert stale.stderr == ""


def test_qserver_pure_runs_python_without_a_word(built_copy: Path):
    pure = _probe(built_copy, QSERVER_PURE="1")
    status, service_file = pure.stdout.splitlines()
    assert status == "pure Python (QSERVER_PURE is set)"
    assert service_file.endswith("service.py") and pure.stderr == ""


def test_without_a_build_it_is_python(tmp_path: Path):
    shutil.copytree(REPO / "qserver", tmp_path / "qserver",
                    ignore=shutil.ignore_patterns("__pycache__", "_compiled", "_compiled.old"))
    bare = _probe(tmp_path)
    assert bare.stdout.splitlines()[0] == "pure Python (not built)" and bare.stderr == ""


def test_a_build_of_another_module_list_is_not_used(built_copy: Path):
    manifest = built_copy / "qserver" / "_compiled" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"qserver.stats"', '"qserver.other"'))
    other = _probe(built_copy)
    assert other.stdout.splitlines()[0].startswith("pure Python (built for another module list;")


# The tests of what the compiled modules do (codec, requests, entries, log,
# messages, the native core and its driver, forwarding, the service, the
# client protocols), in process, where they are quick.
PURE_TESTS = (
    "tests/test_protocol.py", "tests/test_requests.py", "tests/test_entries.py",
    "tests/test_log.py", "tests/test_messages.py", "tests/test_core_fast_path.py",
    "tests/test_fast_path.py", "tests/test_service.py", "tests/test_forwarding.py",
    "tests/test_turn_end_sends.py", "tests/test_answer_flush.py",
)


def test_the_pure_python_modules_pass_the_same_tests():
    if not compiled.active():
        pytest.skip(f"this run is pure Python already ({compiled.status()})")
    env = dict(os.environ, QSERVER_PURE="1")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x",
         *PURE_TESTS],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]
