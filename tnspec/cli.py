"""The ``tnspec`` command line: ``check`` (and, as they land, ``compile``, ``explain``, ``draw``).

Exit codes: 0 success, 2 a spec error or unreadable file (like a compiler), 1 anything else.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from . import __version__
from .api import compile_all
from .errors import SpecError

EXIT_OK, EXIT_FAILURE, EXIT_SPEC = 0, 1, 2

EPILOG = """examples:
  tnspec check examples/*.tn
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_FAILURE
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tnspec", description="Compile tensor-network specs into initialized PyTorch layers.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tnspec {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    check = sub.add_parser("check", help="check .tn files and summarize each layer",
                           description="Check .tn files; print FILE:LINE:COL errors or one "
                           "summary line per layer. Exit code 2 on any error.")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(run=_check)
    return parser


def _read(path: str) -> str:
    """The text of ``path``; a SpecError naming the file if it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError(f"cannot read the file: {reason}", filename=path) from None


def _check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            networks = compile_all(_read(path))
        except SpecError as exc:
            for err in exc.with_filename(path).errors:
                print(err.render(), file=sys.stderr)
            status = EXIT_SPEC
            continue
        for net in networks:
            print(f"{path}: {net.name or 'network'}: {net.summary()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
