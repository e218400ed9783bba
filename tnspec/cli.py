"""The ``tnspec`` command line: ``check``, ``compile``, ``explain``, ``draw`` and ``calibrate``.

Exit codes: 0 success, 2 a spec error, unreadable file or usage error (like a compiler),
1 anything else.
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from ._version import __version__
from .errors import SpecError
from .shapes import example_shape
from .language.settings import option_value
from .planning import calibration, choices
from .planning.report import explain
from .emit.draw import RENDERED, render, to_dot
from .nn.api import compile, compile_all, generate

EXIT_OK, EXIT_FAILURE, EXIT_SPEC = 0, 1, 2

EPILOG = """examples:
  tnspec check examples/*.tn
  tnspec compile examples/htk2.tn -o layer.py
  tnspec compile examples/tr_conv.tn -o - --shape b=128,h=32,w=32 --set r=8 --init graph-out
  tnspec explain examples/htk2.tn --init graph-out
  tnspec check examples/tr_conv.tn --set r=4
  tnspec draw examples/odd.tn -o odd.svg        (SVG, PNG, PDF need Graphviz; .dot does not)
  tnspec calibrate --refresh                    (measure this CPU again for the planner)
  tnspec calibrate --show                       (the measured orders and ops, with margins)

exit codes:
  0  success
  1  no command given, or an unexpected failure
  2  a spec error (printed as FILE:LINE:COL), an unreadable file or a usage error;
     no output file was written
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
    check.add_argument("--layer", action="append", metavar="NAME",
                       help="check only this layer (may be repeated)")
    check.add_argument("--set", type=_assignments, default={}, metavar="r=8,...",
                       help="override size parameters of the layers that declare them")
    check.set_defaults(run=_check)

    comp = sub.add_parser("compile", help="write a standalone PyTorch module",
                          description="Compile the layers of a .tn file into one Python module "
                          "(one class per layer) that imports only torch. The file is written "
                          "only after the whole compile succeeded.")
    _file_options(comp, "the .py file to write, or - for standard output",
                  "override size parameters of the layers that declare them")
    _layer_options(comp, "compile only this layer (may be repeated)", "append",
                   "override every layer's init option")
    comp.set_defaults(run=_compile)

    expl = sub.add_parser("explain", help="explain a layer: roles, backbone graphs, init, plan",
                          description="Print a layer's indices by role, the backbone graphs of "
                          "its forward and backward networks, the variance formula with "
                          "numbers, the std of each core, the compression and the plan.")
    expl.add_argument("file", metavar="FILE")
    expl.add_argument("--set", type=_assignments, default={}, metavar="r=8,...",
                      help="override size parameters of the layer")
    _layer_options(expl, "the layer (default: the only one)", "store",
                   "explain this init instead of the layer's")
    expl.set_defaults(run=_explain)

    draw = sub.add_parser("draw", help="draw a layer's hypergraph as Graphviz DOT, SVG, PNG or "
                          "PDF", description="Draw the tensor network: operands, edges labelled "
                          "with their sizes, hyperedges as points, convolutions as dummy "
                          "tensors P. The format follows OUT's suffix: .dot, or .svg, .png, "
                          ".pdf (these need Graphviz).")
    _file_options(draw, "net.dot, net.svg, net.png, net.pdf, or - for DOT on standard output",
                  "override size parameters")
    draw.add_argument("--layer", metavar="NAME", help="the layer (default: the only one)")
    draw.set_defaults(run=_draw)

    cal = sub.add_parser("calibrate", help="show or refresh the planner's measured cost model",
                         description="Show the cost model the planner uses on a device (measured "
                         "there on first use, under a second, then read from the cache), and "
                         f"every cached one. {calibration.ENV_DIR} moves the cache; "
                         f"{calibration.ENV_SWITCH}=0 makes layers use the built-in constants.")
    cal.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    cal.add_argument("--dtype", default="float32", choices=_DTYPES,
                     help="the parameters' dtype (default float32)")
    cal.add_argument("--refresh", action="store_true", help="measure again and rewrite the cache")
    cal.add_argument("--show", action="store_true",
                     help="list the measured choices (orders, cuts, ops) with their margins")
    cal.add_argument("--forget", metavar="PATTERN",
                     help="drop the measured choices whose key matches PATTERN (a glob with * "
                     "and ?, or a part of the key): they are timed again when next used")
    cal.set_defaults(run=_calibrate)
    return parser


_DTYPES = ("bfloat16", "float16", "float32", "float64")


def _file_options(parser: argparse.ArgumentParser, output_help: str, set_help: str) -> None:
    """FILE, -o OUT and --set, shared by the commands that write a file."""
    parser.add_argument("file", metavar="FILE")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help=output_help)
    parser.add_argument("--set", type=_assignments, default={}, metavar="r=8,...",
                        help=set_help)


def _layer_options(parser: argparse.ArgumentParser, layer_help: str, layer_action: str,
                   init_help: str) -> None:
    """--layer, --shape and --init, shared by the commands that plan a layer."""
    parser.add_argument("--layer", action=layer_action, metavar="NAME", help=layer_help)
    parser.add_argument("--shape", type=_assignments, default={}, metavar="b=32,h=32,...",
                        help="input sizes to plan the contraction order for (default 32 each)")
    parser.add_argument("--init", metavar="MODE", help=init_help)


def _assignments(text: str) -> dict[str, int]:
    """``"a=1,b=2"`` -> ``{"a": 1, "b": 2}`` (argparse type)."""
    out: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"expected NAME=INT, got {item!r}")
        out[key.strip()] = int(value)
    return out


def _read(path: str) -> str:
    """The text of ``path``; a SpecError naming the file if it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark is not text
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SpecError(f"cannot read the file: {reason}", filename=path) from None


def _check(args: argparse.Namespace) -> int:
    status = EXIT_OK
    for path in args.files:
        try:
            networks = compile_all(_read(path), names=args.layer, sizes=args.set)
        except SpecError as exc:
            status = _report(exc, path)
            continue
        for net in networks:
            print(f"{path}: {net.name or 'network'}: {net.summary()}")
    return status


def _compile(args: argparse.Namespace) -> int:
    try:
        text = _read(args.file)
        source = generate(text, names=args.layer, shape=args.shape, init=args.init,
                          source=args.file, sizes=args.set)
    except SpecError as exc:
        return _report(exc, args.file)
    return _emit(args.output, source, args.file)


def _explain(args: argparse.Namespace) -> int:
    try:
        net = compile(_read(args.file), name=args.layer, sizes=args.set)
        if args.init is not None:
            option_value("init", args.init)
        print(explain(net, args.init, example_shape(net, args.shape)))
    except SpecError as exc:
        return _report(exc, args.file)
    return EXIT_OK


def _draw(args: argparse.Namespace) -> int:
    try:
        suffix = Path(args.output).suffix
        if args.output != "-" and suffix not in (".dot", ".gv") + RENDERED:
            raise SpecError(f"cannot tell the format of {args.output!r}",
                            hint="end the output name in .dot, .svg, .png or .pdf")
        dot = to_dot(compile(_read(args.file), name=args.layer, sizes=args.set))
        out: str | bytes = render(dot, suffix[1:]) if suffix in RENDERED else dot
    except SpecError as exc:
        return _report(exc, args.file)
    return _emit(args.output, out, args.file)


def _calibrate(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: the other commands do not need it loaded this early

    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available")
        if device.type not in ("cpu", "cuda"):
            raise RuntimeError("only cpu and cuda devices are measured")
    except RuntimeError as exc:
        print(f"tnspec calibrate: error: cannot measure device {args.device!r}: {exc}",
              file=sys.stderr)
        return EXIT_SPEC
    if args.forget is not None:
        print(f"dropped {calibration.drop(args.forget)} measured choices matching "
              f"{args.forget!r} from {calibration.cache_path()}")
        return EXIT_OK
    if args.show:
        found_choices = calibration.choices()
        print(f"cache: {calibration.cache_path()}; {len(found_choices)} measured choices")
        device_part = None
        for key, value in sorted(found_choices.items(), key=lambda kv: kv[0].split(" | ", 3)[:3]):
            if key.split(" | ", 3)[:3] != device_part:
                device_part = key.split(" | ", 3)[:3]
                print("\n" + " | ".join(device_part) + ":")
            print(choices.describe(key, value))
        return EXIT_OK
    found = calibration.calibrate(device, getattr(torch, args.dtype),
                                  refresh=args.refresh)
    print(f"cache: {calibration.cache_path()}")
    if not calibration.enabled():
        print(f"note: {calibration.ENV_SWITCH}=0 is set, so layers plan with the built-in "
              "constants, not with these")
    print("in use: " + found.describe())
    others = [c for c in calibration.cached() if c.key != found.key]
    for other in others:
        print("also cached: " + other.describe())
    return EXIT_OK


def _report(exc: SpecError, path: str) -> int:
    """Print every error of ``exc`` as FILE:LINE:COL; the spec-error exit code."""
    for err in exc.with_filename(path).errors:
        print(err.render(), file=sys.stderr)
    return EXIT_SPEC


def _emit(output: str, text: str | bytes, spec_file: str) -> int:
    """Write ``text`` to standard output (``-``) or to the file ``output``: a regular file is
    replaced atomically (keeping its mode), a FIFO or device is written through, a symlink is
    followed. A path that cannot be written is a one-line error with the spec-error code."""
    if output == "-":
        sys.stdout.write(text if isinstance(text, str) else text.decode())
        return EXIT_OK
    data = text.encode("utf-8") if isinstance(text, str) else text
    path = Path(output)
    try:
        target = path.resolve() if path.is_symlink() else path
        if target.is_dir():
            raise OSError(errno.EISDIR, "is a directory")
        if target.exists() and target.samefile(spec_file):
            raise OSError(errno.EEXIST, "it is the spec file being compiled")
        if not target.parent.is_dir():
            raise OSError(errno.ENOENT, f"the directory {str(target.parent)!r} does not exist")
        if target.exists() and not target.is_file():  # a FIFO, /dev/null, a terminal...
            with open(target, "wb") as fh:
                fh.write(data)
        else:
            _write_atomically(target, data)
    except OSError as exc:
        print(f"tnspec: error: cannot write {output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_SPEC
    print(f"wrote {output}", file=sys.stderr)
    return EXIT_OK


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path``, then rename it over ``path``; the file gets
    the mode of the one it replaces, or the umask's default for a new file."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mask = os.umask(0)
        os.umask(mask)
        mode = 0o666 & ~mask
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


if __name__ == "__main__":
    sys.exit(main())
