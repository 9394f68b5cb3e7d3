"""`python -m bench [e2e] [options]` (also `tokenmill bench`, `./dev bench`).

With `e2e`: `tokenmill export` against the hand-written script, cold and warm (bench/e2e.py).
Otherwise: the side-by-side suite (bench/suite.py). Each parses its own options.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["e2e"]:
        from bench.e2e import main as e2e_main

        return e2e_main(argv[1:])
    from bench.suite import main as suite_main

    return suite_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
