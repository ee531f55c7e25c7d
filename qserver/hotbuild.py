"""Build the hot path's compiled modules (qserver/compiled.py).

    python -m qserver.hotbuild build     # compile HOT with mypyc; 1 if it failed
    python -m qserver.hotbuild ensure    # compile if the build is missing or stale; always 0
    python -m qserver.hotbuild status    # what `import qserver` uses in this environment

`make run` and `make test` run `ensure`: a machine without a C compiler
(or without mypy) gets a warning and runs the pure-Python modules.
"""

from __future__ import annotations

import sys

from . import compiled as this

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["ensure"]:  # make's step: build if needed; never fails make
        reason = this.check()
        if reason is None:
            return 0
        print(f"qserver: compiling the hot path ({reason}; about two minutes)")
        main(["build"])
        return 0
    if args == ["build"]:
        try:
            code = this.build(quiet=True)
        except (Exception, SystemExit) as exc:  # no compiler, no mypy, a mypyc error: pure Python
            print(f"qserver: could not compile the hot path ({type(exc).__name__}: {exc}); "
                  f"qserver runs as pure Python", file=sys.stderr)
            return 1
        if code == 0:
            print(f"qserver: compiled {len(this.HOT)} modules into {this.BUILD_DIR}")
        return code
    if args == ["status"]:
        this.install()
        print(this.status())
        return 0
    print("usage: python -m qserver.hotbuild build|ensure|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
