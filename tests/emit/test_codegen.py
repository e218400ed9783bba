"""Generated modules: flake-clean, standalone (torch only), identical to the inline module."""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pycodestyle
import pytest
import torch
from pyflakes.api import check as pyflakes_check
from pyflakes.reporter import Reporter

import tnspec
from tnspec.nn.api import example_shape, generate
from tnspec.cli import main

from ..conftest import EXAMPLES, ROOT
from ..generated import assert_same, class_for, load


def example_input(net) -> torch.Tensor:
    return torch.randn(*example_shape(net, {"b": 2}, default=9))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_generated_module_equals_inline_module(path, tmp_path):
    text = path.read_text()
    for net in tnspec.compile_all(text):
        # planned for the same shape as the inline module sees, so the order is the same
        shape = {i: 2 if net.index(i).role.value == "batch" else 9
                 for i in [*net.with_role(tnspec.Role.BATCH), *(c.target for c in net.convs)]}
        module = load(generate(text, names=[net.name], shape=shape), tmp_path,
                      f"{path.stem}_{net.name}")
        torch.manual_seed(1)
        inline = tnspec.layer(text, name=net.name)
        torch.manual_seed(1)
        generated = class_for(module, net)()
        assert generated.spec == inline.spec and generated.sizes == inline.sizes
        torch.manual_seed(2)
        with torch.no_grad():  # a non-zero bias, so that it is compared too
            for m in (inline, generated):
                if m.bias is not None:
                    m.bias.copy_(torch.linspace(-1, 1, m.bias.numel()).reshape(m.bias.shape))
        assert_same(inline, generated, example_input(net))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_generated_code_is_flake_clean(path):
    source = generate(path.read_text(), source=str(path))
    out = io.StringIO()
    assert pyflakes_check(source, str(path), Reporter(out, out)) == 0, out.getvalue()
    style = pycodestyle.Checker(lines=source.splitlines(True), max_line_length=99,
                                show_source=True, quiet=True)
    with redirect_stdout(io.StringIO()) as report:
        errors = style.check_all()
    assert errors == 0, report.getvalue()


def test_generated_module_imports_only_torch_and_runs_without_tnspec(tmp_path):
    source = generate((EXAMPLES[0].parent / "tr_conv.tn").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import) else [node])
                for alias in ([alias] if isinstance(node, ast.Import) else [])} | {
        node.module.split(".")[0] for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)}
    assert imported == {"torch"}
    (tmp_path / "tr_layer.py").write_text(source)
    script = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'tnspec':\n"
        "            raise ImportError('tnspec is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, tr_layer\n"
        "m = tr_layer.TrConv(r=4)\n"
        "print(tuple(m(torch.randn(2, 96, 8, 8)).shape))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(2, 96, 8, 8)"


def test_constructor_arguments_are_the_size_parameters(tmp_path):
    text = (EXAMPLES[0].parent / "htk2.tn").read_text()
    module = load(generate(text, shape=dict(b=2, h=9, w=9), r0=4, phi=2, k=5), tmp_path,
                  "htk2_sizes")
    torch.manual_seed(0)
    generated = module.Htk2(r0=4, phi=2, k=5, bias=False)
    torch.manual_seed(0)
    inline = tnspec.layer(text, r0=4, phi=2, k=5, bias=False)
    assert generated.sizes == inline.sizes and generated.bias is None
    assert_same(inline, generated, torch.randn(2, 64, 9, 9))


def test_hostile_names_are_mangled_and_parameters_keep_their_spec_names(tmp_path):
    text = "x[b, def, t+class-1], lambda[def, class, self], I[self, torch] -> y[b, torch, t]"
    sizes = {"def": 2, "class": 3, "self": 2, "torch": 4}
    module = load(generate(text, shape=dict(b=2, t=7), **sizes), tmp_path, "hostile")
    torch.manual_seed(0)
    inline = tnspec.layer(text, **sizes)
    torch.manual_seed(0)
    generated = module.TensorNetworkLayer()
    assert dict(generated.named_parameters()).keys() == {"lambda", "I", "bias"}
    assert_same(inline, generated, torch.randn(2, 2, 7))


def test_wrong_input_shape_names_the_expected_size(tmp_path):
    text = (EXAMPLES[0].parent / "htk2.tn").read_text()
    module = load(generate(text), tmp_path, "htk2_shape")
    for m in (tnspec.layer(text), module.Htk2()):
        with pytest.raises(ValueError, match=r"x: expected shape \[b, c=64, h\+kh-1, w\+kw-1\] or, "
                                             r"unbatched, .*, got \[2, 32, 8, 8\]"):
            m(torch.randn(2, 32, 8, 8))
        with pytest.raises(ValueError, match=r"expected shape .* got \[64, 8\]"):
            m(torch.randn(64, 8))
        # an unbatched input of the wrong size: the shape as given, not with the batch added
        with pytest.raises(ValueError, match=r"x: expected shape \[b, c=64, h\+kh-1, w\+kw-1\] or, "
                                             r"unbatched, \[c=64, h\+kh-1, w\+kw-1\], got "
                                             r"\[2, 64, 8\]$"):
            m(torch.randn(2, 64, 8))


def test_cli_compile_writes_atomically(tmp_path, capsys):
    out = tmp_path / "layer.py"
    assert main(["compile", str(EXAMPLES[0].parent / "htk2.tn"), "-o", str(out)]) == 0
    first = out.read_text()
    assert "class Htk2(nn.Module):" in first
    bad = tmp_path / "bad.tn"
    bad.write_text("layer l(c=2) { x[b, c], W[c, o] -> y[b, o] }")
    assert main(["compile", str(bad), "-o", str(out)]) == 2
    assert out.read_text() == first  # a failed compile leaves the old file alone
    assert f"{bad}:1:30: error: core index 'o' has no size" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_compile_options(tmp_path, capsys):
    path = str(EXAMPLES[0].parent / "tensorized_linear.tn")
    assert main(["compile", path, "-o", "-", "--layer", "linear2", "--set", "r=3",
                 "--init", "graph-out", "--shape", "b=8"]) == 0
    source = capsys.readouterr().out
    assert "class Linear2" in source and "class Linear1" not in source
    assert "r: int = 3" in source and "init graph-out" in source and "planned for b=8" in source
    with pytest.raises(SystemExit):
        main(["compile", path, "-o", "-", "--shape", "b=x"])


def test_plan_report_for_tr_names_kinds_and_beats_dense():
    layer = tnspec.layer((EXAMPLES[0].parent / "tr_conv.tn").read_text())
    plan = layer.plan((32, 96, 32, 32))
    report = plan.report()
    assert plan.flops < 2 * plan.dense_macs
    assert "vs dense" in report and "x fewer" in report
    rows = report.splitlines()[4:]
    assert len(rows) == len(plan.steps) == 7
    assert [r.split()[1] for r in rows] == [s.op for s in plan.steps]  # exactly what runs
    assert sum(s.op == "conv" for s in plan.steps) == 1


def test_crafted_text_cannot_run_code_in_the_generated_module(tmp_path):
    """Comments, layer and parameter names, and the source path end up in the module only as
    comments, string literals or mangled identifiers: nothing a spec writes is executed."""
    marker = tmp_path / "pwned"
    payload = f'""" ; import os ; os.system("touch {marker}") ; """'
    text = (f"# {payload}\n# \\\n"
            "layer exec(print=4, open=3, r=2, nn=2) {  # ''' __import__('os') \\\n"
            "    kh = open\n"
            "    x[b, print, t+kh-1], os[print, r], system[r, kh, open], math[open, nn]"
            " -> y[b, nn, t]\n}\n")
    source = generate(text, source=f'evil"""\nimport os\nos.system("touch {marker}")  # \\')
    tree = ast.parse(source)
    imports = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    imports |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imports <= {"torch", "torch.nn.functional", "math", "__future__"}
    calls = {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not calls & {"os.system", "__import__", "eval", "exec", "print", "open"}
    assert str(marker) not in "".join(n.value for n in ast.walk(tree)
                                      if isinstance(n, ast.Constant) and isinstance(n.value, str))
    module = load(source, tmp_path, "hostile_text")
    layer = module.Exec()
    assert dict(layer.named_parameters()).keys() == {"os", "system", "math", "bias"}
    assert layer(torch.randn(2, 4, 9)).shape == (2, 2, 9)
    assert not marker.exists()


def test_planned_intermediates_are_bounded_before_anything_is_allocated():
    module = tnspec.layer("x[b, c, h+k-1], U[c, r], V[r, o, k] -> y[b, o, h]", c=8, r=4, o=8,
                          k=3, max_bytes=10_000)
    module(torch.randn(2, 8, 100))
    with pytest.raises(tnspec.SpecError, match=r"t2\[b, o, h\] would take 62.5 KiB \(16,000 "
                       r"elements at the batch b=2\), more than the limit of 9.8 KiB"):
        module(torch.randn(2, 8, 1000))


def test_generated_source_does_not_depend_on_the_process_hash_seed(tmp_path):
    """`tnspec compile` is reproducible: two processes with different string hashes (hence
    different set orders) write the same text, for every example and some random formats,
    and give its code the same fingerprint (what the autotuner's cache recalls orders by)."""
    code = ("import sys, pathlib, tnspec\n"
            "from tnspec.emit import runtime\n"
            "from tnspec.shapes import example_shape\n"
            "for p in sorted(pathlib.Path(sys.argv[1], 'examples').glob('*.tn')):\n"
            "    print(tnspec.generate(p.read_text()))\n"
            "for seed in range(8):\n"
            "    f = tnspec.formats.random(seed)\n"
            "    print(tnspec.generate(f.spec, sizes=f.sizes))\n"
            "    layer = f.layer(autotune=False)\n"
            "    shape = tuple(example_shape(layer.network, {}))\n"
            "    print(runtime.fingerprint(layer._planned(shape)))\n")
    outputs = []
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "TNSPEC_CALIBRATE": "0"}
        out = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, text=True,
                             capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr
        outputs.append(out.stdout)
    assert outputs[0] == outputs[1] == outputs[2]
