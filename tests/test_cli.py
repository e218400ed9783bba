"""The ``tnspec`` command line: check, exit codes, FILE:LINE:COL errors."""

from __future__ import annotations

import io
import os
import re
import shutil
import stat
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace
from xml.etree import ElementTree

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tnspec
from tnspec import __version__
from tnspec.cli import main

from .conftest import EXAMPLES, ROOT


def test_check_examples_prints_one_summary_per_layer(capsys):
    assert main(["check", *map(str, EXAMPLES)]) == 0
    lines = capsys.readouterr().out.splitlines()
    n_layers = sum(p.read_text().count("\nlayer ") + p.read_text().startswith("layer ")
                   for p in EXAMPLES)
    assert len(lines) == n_layers
    assert any(line.endswith("htk2: 3 cores, 8,720 parameters (dense 36,864, 4.2x fewer), "
                             "2-D conv, hyperedge phi") for line in lines)


def test_check_reports_file_line_column_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.tn"
    bad.write_text("# a layer with two mistakes\nlayer l(c=4) {\n"
                   "    x[b, c, h+k+1], W[c, o, k] -> y[b, o, h]\n}\n")
    assert main(["check", str(bad), str(EXAMPLES[0])]) == 2
    out = capsys.readouterr()
    assert f"{bad}:3:13: error: constant +1 in 'h+k+1' means negative padding" in out.err
    assert f"{bad}:3:26: error: core index 'o' has no size" in out.err
    assert "    x[b, c, h+k+1], W[c, o, k] -> y[b, o, h]\n" in out.err
    assert "\n              ^^^^^\n" in out.err
    assert "hint: write the padding as a subtraction" in out.err
    assert str(EXAMPLES[0]) in out.out  # the good file is still checked


def test_unreadable_file(capsys):
    assert main(["check", "no/such/file.tn"]) == 2
    assert "no/such/file.tn: error: cannot read the file" in capsys.readouterr().err


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"tnspec {__version__}"
    assert main([]) == 1
    assert "check" in capsys.readouterr().out


def test_console_script_works_from_another_directory(tmp_path):
    exe = "tnspec" if os.name != "nt" else "tnspec.exe"
    script = os.path.join(os.path.dirname(sys.executable), exe)
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "tnspec"]
    proc = subprocess.run([*cmd, "check", str(ROOT / "examples" / "htk2.tn")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "htk2: 3 cores" in proc.stdout


def test_explain_shows_backbones_formula_std_compression_and_plan(capsys):
    assert main(["explain", str(ROOT / "examples" / "htk2.tn"), "--init", "graph-out",
                 "--shape", "b=8,h=16,w=16"]) == 0
    out = capsys.readouterr().out
    for piece in ("indices by role:", "hyperedge    phi=4", "backbone graph, graph-in",
                  "backbone graph, graph-out", "S_in = c * r0 * phi * r1 * kh * kw",
                  "= 230,400", "graph-out: prod_c Var(W_c) = 1 / (p_a S_out)",
                  "std per core (graph-out):", "compression 4.2x", "plan (auto)",
                  "FLOPs vs dense"):
        assert piece in out, piece
    assert f"std = {(0.5 * 230400) ** (-1 / 6):.6g}" in out


def test_explain_errors(capsys):
    assert main(["explain", str(ROOT / "examples" / "htk2.tn"), "--init", "nope"]) == 2
    assert "invalid init: 'nope'" in capsys.readouterr().err
    assert main(["explain", str(ROOT / "examples" / "depthwise_separable.tn")]) == 2
    assert "say which one" in capsys.readouterr().err


def test_draw_writes_the_hypergraph_as_dot(tmp_path, capsys):
    out = tmp_path / "htk2.dot"
    assert main(["draw", str(ROOT / "examples" / "htk2.tn"), "-o", str(out)]) == 0
    dot = out.read_text()
    assert dot.startswith('graph "htk2" {') and dot.rstrip().endswith("}")
    assert '"G" [shape=box, label="G[r0, r1, kh, kw, phi]"];' in dot
    assert '"U" -- "G" [label="r0=10"];' in dot
    assert dot.count('-- "hyperedge:phi";') == 3  # phi joins all three cores
    assert '"x" -- "P0:h" [label="h+kh-1"];' in dot and '"G" -- "P0:h" [label="kh"];' in dot
    assert main(["draw", str(ROOT / "examples" / "odd.tn"), "-o", "-", "--set", "r=2"]) == 0
    odd = capsys.readouterr().out
    assert odd.count("[shape=box") == 9 and odd.count("=2\"];") == 14  # 14 rank edges


def test_set_reaches_parameters_named_like_api_keywords(tmp_path, capsys):
    spec = tmp_path / "lin.tn"
    spec.write_text("layer lin(name=4, init=3) {\n    x[b, name], W[name, init] -> y[b, init]\n}\n")
    assert main(["draw", str(spec), "-o", "-", "--set", "name=5"]) == 0
    assert '"x" -- "W" [label="name=5"];' in capsys.readouterr().out
    assert main(["compile", str(spec), "-o", "-", "--set", "init=7"]) == 0
    assert "name: int = 4, init: int = 7" in capsys.readouterr().out


def test_draw_svg_goes_through_graphviz(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "dot"  # stands in for Graphviz: wraps its input in an <svg> element
    fake.write_text(f"#!{sys.executable}\nimport sys\n"
                    "print('<svg>' + str(len(sys.stdin.read())) + '</svg>')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "net.svg"
    assert main(["draw", str(ROOT / "examples" / "cp.tn"), "-o", str(out)]) == 0
    assert out.read_text().startswith("<svg>")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    missing = tmp_path / "other.svg"
    assert main(["draw", str(ROOT / "examples" / "cp.tn"), "-o", str(missing)]) == 2
    assert "needs Graphviz's `dot` program" in capsys.readouterr().err
    assert not missing.exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_draw_svg_with_real_graphviz(path, tmp_path):
    for net in tnspec.compile_all(path.read_text()):
        out = tmp_path / f"{net.name}.svg"
        assert main(["draw", str(path), "--layer", net.name, "-o", str(out)]) == 0
        svg = ElementTree.parse(out).getroot()  # well-formed XML
        assert svg.tag == "{http://www.w3.org/2000/svg}svg"
        texts = {t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")}
        for core in net.cores:
            assert any(t and t.startswith(core.name + "[") for t in texts), core.name


def test_draw_refuses_an_unknown_suffix_and_bad_specs(tmp_path, capsys):
    assert main(["draw", str(ROOT / "examples" / "cp.tn"), "-o", str(tmp_path / "a.jpg")]) == 2
    assert "cannot tell the format of" in capsys.readouterr().err
    bad = tmp_path / "bad.tn"
    bad.write_text("x[b, c], W[c, o] -> y[b, o]\n")
    assert main(["draw", str(bad), "-o", str(tmp_path / "a.dot")]) == 2
    assert f"{bad}:1:" in capsys.readouterr().err and not (tmp_path / "a.dot").exists()


def test_help_documents_exit_codes_and_examples(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "exit codes:" in text and "tnspec draw examples/odd.tn -o odd.svg" in text
    with pytest.raises(SystemExit) as exc:
        main(["compile"])  # a usage error: argparse exits with 2
    assert exc.value.code == 2


# ---- -o: what the output path may be -------------------------------------------------------

CP = str(ROOT / "examples" / "cp.tn")


def test_output_through_a_symlink_writes_the_target_and_keeps_the_link(tmp_path, capsys):
    (tmp_path / "real.py").write_text("old")
    (tmp_path / "link.py").symlink_to("real.py")
    assert main(["compile", CP, "-o", str(tmp_path / "link.py")]) == 0
    assert (tmp_path / "link.py").is_symlink()
    assert "class Cp(nn.Module)" in (tmp_path / "real.py").read_text()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_output_to_a_fifo_is_written_through(tmp_path, capsys):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    try:
        assert main(["compile", CP, "-o", str(fifo)]) == 0
        text, _ = reader.communicate(timeout=30)
    finally:
        reader.kill()  # a reader left waiting on a FIFO that was replaced would hang on
    assert "class Cp(nn.Module)" in text
    assert fifo.is_fifo()


def test_output_to_a_character_device_is_written_through(tmp_path, capsys):
    # a null device of our own: the system's /dev/null is never put at risk by this test
    null = tmp_path / "null"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (OSError, AttributeError):
        pytest.skip("cannot create a device node here")
    before = os.stat(null)
    assert main(["compile", CP, "-o", str(null)]) == 0
    after = os.stat(null)
    assert (after.st_ino, after.st_mode, after.st_rdev) == \
        (before.st_ino, before.st_mode, before.st_rdev)
    assert stat.S_ISCHR(after.st_mode)


def test_a_new_file_gets_the_umask_mode_and_a_replaced_file_keeps_its_mode(tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["compile", CP, "-o", str(tmp_path / "new.py")]) == 0
        kept = tmp_path / "kept.py"
        kept.write_text("old")
        kept.chmod(0o640)
        assert main(["compile", CP, "-o", str(kept)]) == 0
    finally:
        os.umask(old)
    assert (tmp_path / "new.py").stat().st_mode & 0o777 == 0o644
    assert kept.stat().st_mode & 0o777 == 0o640 and "class Cp" in kept.read_text()


@pytest.mark.parametrize("target, message", [
    ("missing/x.py", "the directory '.*missing' does not exist"),
    ("adir", "is a directory"),
    ("cp.tn", "it is the spec file being compiled"),
])
def test_an_unwritable_output_is_a_one_line_error_with_exit_2(target, message, tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    spec = tmp_path / "cp.tn"
    spec.write_text((ROOT / "examples" / "cp.tn").read_text())
    assert main(["compile", str(spec), "-o", str(tmp_path / target)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(f"tnspec: error: cannot write .*{target}: {message}", err)
    assert spec.read_text().startswith("# CP convolution")  # the spec is never replaced


@pytest.mark.parametrize("shape, message", [
    ("b=0", "shape b=0 must be a positive int"),
    ("b=-1", "shape b=-1 must be a positive int"),
    ("h=-5", "shape h=-5 must be a positive int"),
    ("c=5", "shape c=5: the spec fixes c=96"),
    ("q=3", "shape q=3 names no index of the input"),
])
def test_bad_shapes_are_spec_errors_with_exit_2(shape, message, tmp_path, capsys):
    out = tmp_path / "layer.py"
    assert main(["compile", CP, "-o", str(out), "--shape", shape]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_kernel_larger_than_the_example_input_is_a_spec_error(tmp_path, capsys):
    out = tmp_path / "layer.py"
    assert main(["compile", CP, "-o", str(out), "--set", "k=99"]) == 2
    assert "cannot be planned for the input shape [32, 96, 32, 32]" in capsys.readouterr().err
    assert not out.exists()
    assert main(["compile", CP, "-o", str(out), "--set", "k=99", "--shape", "h=100,w=100"]) == 0


def test_a_file_with_a_byte_order_mark_is_read(tmp_path, capsys):
    spec = tmp_path / "bom.tn"
    spec.write_bytes(b"\xef\xbb\xbf" + (ROOT / "examples" / "cp.tn").read_bytes())
    assert main(["check", str(spec)]) == 0
    assert "cp: 4 cores" in capsys.readouterr().out


# ---- fuzzing -o, --shape and --set -------------------------------------------------------

ASSIGNMENT = st.tuples(st.sampled_from(["b", "h", "w", "c", "r", "k", "o", "q", "", "h+kh-1"]),
                       st.sampled_from(["0", "-1", "1", "7", "32", "x", "", "1e3", "99999999"]))
TARGETS = ["new.py", "old.py", "link.py", "adir", "missing/x.py", "spec.tn", "dangling.py"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=st.sampled_from(TARGETS), shape=st.lists(ASSIGNMENT, max_size=3),
       sets=st.lists(ASSIGNMENT, max_size=3))
def test_compile_either_writes_a_module_or_exits_2_leaving_everything_as_it_was(
        tmp_path_factory, target, shape, sets):
    root = tmp_path_factory.mktemp("cli")
    spec = root / "spec.tn"
    spec.write_text((ROOT / "examples" / "cp.tn").read_text())
    (root / "old.py").write_text("old")
    (root / "adir").mkdir()
    (root / "link.py").symlink_to("old.py")
    (root / "dangling.py").symlink_to("nowhere.py")
    before = {p.name: (p.is_symlink(), p.read_bytes() if p.is_file() else None)
              for p in root.iterdir()}
    args = ["compile", str(spec), "-o", str(root / target)]
    if shape:
        args += ["--shape", ",".join(f"{k}={v}" for k, v in shape)]
    if sets:
        args += ["--set", ",".join(f"{k}={v}" for k, v in sets)]
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        try:
            code = main(args)  # anything but a SpecError or a usage error would raise here
        except SystemExit as exc:  # argparse: a malformed NAME=INT
            code = exc.code
    result = SimpleNamespace(returncode=code, stderr=err.getvalue())
    assert result.returncode in (0, 2), result.stderr
    after = {p.name: (p.is_symlink(), p.read_bytes() if p.is_file() else None)
             for p in root.iterdir()}
    if result.returncode == 2:
        assert after == before, result.stderr
        return
    written = (root / target).resolve()
    compile(written.read_text(), str(written), "exec")
    others = {p.name for p in root.iterdir() if p.resolve() != written}
    assert {k: after[k] for k in others} == {k: before.get(k) for k in others}
    assert (root / "link.py").is_symlink() and spec.read_text() == before["spec.tn"][1].decode()


def test_draw_png_and_pdf_go_through_graphviz_as_bytes(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "dot"  # stands in for Graphviz: writes the format it was asked for
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stdin.read()\n"
                    "sys.stdout.buffer.write(b'\\x89' + sys.argv[1].encode() + b'\\x00')\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for fmt in ("png", "pdf"):
        out = tmp_path / f"net.{fmt}"
        assert main(["draw", str(ROOT / "examples" / "cp.tn"), "-o", str(out)]) == 0
        assert out.read_bytes() == b"\x89-T" + fmt.encode() + b"\x00"


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_draw_png_and_pdf_with_real_graphviz(tmp_path):
    for fmt, magic in (("png", b"\x89PNG"), ("pdf", b"%PDF")):
        out = tmp_path / f"odd.{fmt}"
        assert main(["draw", str(ROOT / "examples" / "odd.tn"), "-o", str(out)]) == 0
        assert out.read_bytes().startswith(magic)


def test_check_and_explain_take_set_and_layer(tmp_path, capsys):
    two = tmp_path / "two.tn"
    two.write_text((ROOT / "examples" / "cp.tn").read_text() + "\n" +
                   (ROOT / "examples" / "tucker2.tn").read_text())
    assert main(["check", str(two), "--layer", "cp", "--set", "r=4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"{two}: cp: 4 cores, 792 parameters")
    assert main(["check", str(two), "--set", "zz=4"]) == 2
    assert "no layer has a parameter named 'zz'; the parameters are: c, o, r, k" in \
        capsys.readouterr().err
    assert main(["compile", str(ROOT / "examples" / "htk2.tn"), "--set", "r=4", "-o", "-"]) == 2
    err = capsys.readouterr().err
    assert "no layer has a parameter named 'r'; the parameters are: c, o, r0, r1, k, phi" in err
    assert "hint: did you mean 'r1'?" in err
    assert main(["explain", str(ROOT / "examples" / "cp.tn"), "--set", "r=4"]) == 0
    assert "hyperedge    r=4" in capsys.readouterr().out
    assert main(["explain", str(two), "--layer", "cp", "--set", "q=4"]) == 2
    assert "size q=4 names no parameter of the layer" in capsys.readouterr().err
