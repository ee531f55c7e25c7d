"""Run the `qserver` command with a failure injected into one method, for
the fail-stop tests (tests/test_fail_stop.py). Test-only: nothing in the
qserver package knows of it, so no production code path can fire it.

    python tests/inject_fault.py MODULE:CLASS.METHOD TRIGGER [ERROR] -- ARGS...

runs `qserver ARGS...` (e.g. `run --config node.xml`) with CLASS.METHOD of
MODULE replaced: until the file TRIGGER exists it calls the original; once
it exists, every call raises ERROR (a builtin exception's name, or
InvariantError, the default) with the message "injected failure in
CLASS.METHOD". The test starts the node, lets it serve, then creates the
file.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import os
import sys


def _install(target: str, trigger: str, error: str) -> None:
    module_name, _, attr = target.partition(":")
    class_name, _, method_name = attr.partition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    original = getattr(cls, method_name)
    if error == "InvariantError":
        from qserver.errors import InvariantError as exc_type
    else:
        exc_type = getattr(builtins, error)
    where = f"{class_name}.{method_name}"

    @functools.wraps(original)
    def injected(*args, **kwargs):
        if os.path.exists(trigger):
            raise exc_type(f"injected failure in {where}")
        return original(*args, **kwargs)

    setattr(cls, method_name, injected)


def main() -> int:
    # The methods of a compiled class (qserver/compiled.py) cannot be
    # replaced: the node runs its modules as Python. What is tested, the
    # node stopping on an exception that escapes a callback (node.py, the
    # loop's handler), is the same code either way.
    os.environ["QSERVER_PURE"] = "1"
    args = sys.argv[1:]
    sep = args.index("--")
    target, trigger, *rest = args[:sep]
    _install(target, trigger, rest[0] if rest else "InvariantError")
    from qserver.cli import main as qserver_main
    return qserver_main(args[sep + 1:])


if __name__ == "__main__":
    sys.exit(main())
