"""The ``tnspec`` command line: check, exit codes, FILE:LINE:COL errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from xml.etree import ElementTree

import pytest

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
    assert main(["draw", str(ROOT / "examples" / "cp.tn"), "-o", str(tmp_path / "a.png")]) == 2
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
