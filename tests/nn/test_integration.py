"""Layers where users put them: state_dict, copies, dtypes, torch.compile, torch.export,
TorchScript and ONNX (generated modules), DistributedDataParallel across two processes."""

from __future__ import annotations

import copy
import importlib.util
import json
import pickle
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tnspec
from tnspec.nn.api import generate

from .. import ddp_worker, fsdp_worker
from ..conftest import EXAMPLES, ROOT

TEXT = (EXAMPLES[0].parent / "htk2.tn").read_text()


def make(seed: int = 0) -> tnspec.Layer:
    torch.manual_seed(seed)
    return tnspec.layer(TEXT)


def generated(tmp_path):
    path = tmp_path / "htk2_layer.py"
    path.write_text(generate(TEXT))
    spec = importlib.util.spec_from_file_location("htk2_layer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Htk2()


def test_state_dict_round_trip():
    a, b = make(0), make(1)
    x = torch.randn(2, 64, 8, 8)
    assert not torch.equal(a(x), b(x))
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(x), b(x))
    assert set(a.state_dict()) == {"U", "G", "V", "bias"}


def test_deepcopy_and_pickle():
    a = make()
    x = torch.randn(2, 64, 8, 8)
    assert torch.equal(copy.deepcopy(a)(x), a(x))
    assert torch.equal(pickle.loads(pickle.dumps(a))(x), a(x))


def test_to_bfloat16_and_float64():
    a = make()
    x = torch.randn(2, 64, 8, 8)
    for dtype in (torch.bfloat16, torch.float64):
        b = copy.deepcopy(a).to(dtype)
        y = b(x.to(dtype))
        assert y.dtype == dtype
        assert torch.allclose(y.float(), a(x), rtol=0.05, atol=0.05)


def test_torch_compile_fullgraph_equals_eager():
    torch._dynamo.reset()  # a layer compiled earlier at another size would make this dynamic
    a = make()
    x = torch.randn(2, 64, 8, 8)
    compiled = torch.compile(a, fullgraph=True)
    assert torch.allclose(compiled(x), a(x), rtol=1e-5, atol=1e-5)


def test_torch_compile_with_inductor_for_new_batch_and_spatial_sizes():
    """The common case, a smaller last batch: dynamo retraces with a symbolic batch size. A new
    spatial size with dynamic=False (what the README advises for Inductor) compiles anew."""
    torch._dynamo.reset()
    a = make()
    compiled = torch.compile(a, fullgraph=True)
    for batch in (4, 3, 2):
        x = torch.randn(batch, 64, 8, 8)
        assert torch.allclose(compiled(x), a(x), rtol=1e-4, atol=1e-5)
    static = torch.compile(a, fullgraph=True, dynamic=False)
    for shape in ((2, 64, 8, 8), (2, 64, 12, 10)):
        x = torch.randn(shape)
        assert torch.allclose(static(x), a(x), rtol=1e-4, atol=1e-5)


def test_torch_compile_with_dynamic_shapes():
    """A second input shape makes dynamo trace shapes symbolically; planning must not need
    them as constants. (The aot_eager backend: with symbolic spatial sizes Inductor 2.13 fails
    in its own stride sorting, as it does on plain torch code that reshapes a transposed
    tensor before a conv2d; pytorch/pytorch#185510.)"""
    torch._dynamo.reset()
    a = make()
    compiled = torch.compile(a, fullgraph=True, dynamic=True, backend="aot_eager")
    for shape in ((2, 64, 8, 8), (3, 64, 10, 6)):
        x = torch.randn(shape)
        assert torch.allclose(compiled(x), a(x), rtol=1e-4, atol=1e-5)
    other = tnspec.layer(TEXT, c=32)  # another layer of the same class, another shape
    x = torch.randn(2, 32, 12, 12)
    assert torch.allclose(torch.compile(other, fullgraph=True)(x), other(x), rtol=1e-4,
                          atol=1e-5)


def test_default_torch_compile_of_inline_layers_across_spatial_and_batch_sizes():
    """Default torch.compile (Inductor, shapes made dynamic on the second size) of a model of
    inline layers, with eager calls in between (which re-plan), equals eager at every size."""
    torch._dynamo.reset()
    spec = "x[b, c, h+kh-1, w+kw-1], U[c, r0], G[r0, r1, kh, kw], V[r1, o] -> y[b, o, h, w]"
    torch.manual_seed(0)
    model = torch.nn.Sequential(tnspec.layer(spec, c=8, o=8, r0=3, r1=3, kh=3, kw=3),
                                torch.nn.ReLU(),
                                tnspec.layer(spec, c=8, o=8, r0=3, r1=3, kh=3, kw=3))
    compiled = torch.compile(model)
    for shape in ((2, 8, 16, 16), (3, 8, 12, 12), (5, 8, 9, 7)):
        x = torch.randn(shape)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


# one of each pattern Inductor once failed on with dynamic shapes: an einsum's permuted result
# into a conv (cp, tucker2), a channel permutation (htk2), a channel riding along the batch (tr)
# and a reshaped input (odd-like: one reconstructed kernel)
ZOO = """
layer cp(c=8, o=8, r=3, kh=3, kw=3) {
    x[b, c, h+kh-1, w+kw-1], A[c, r], KH[kh, r], KW[kw, r], B[r, o] -> y[b, o, h, w]
}
layer tucker2(c=8, o=8, r0=2, r1=3, kh=3, kw=3) {
    x[b, c, h+kh-1, w+kw-1], U[c, r0], G[r0, r1, kh, kw], V[r1, o] -> y[b, o, h, w]
}
layer htk2(c=8, o=8, r0=2, r1=2, phi=2, kh=3, kw=3) {
    x[b, c, h+kh-1, w+kw-1], U[c, r0, phi], G[r0, r1, kh, kw, phi], V[r1, o, phi]
        -> y[b, o, h, w]
}
layer tr(c0=2, c1=4, o0=4, o1=2, r0=2, r1=2, r2=2, r3=3, r4=2, kh=3, kw=3) {
    x[b, (c0 c1), h+kh-1, w+kw-1], A0[r0, c0, r1], A1[r1, c1, r2], K[r2, kh, kw, r3],
        B0[r3, o0, r4], B1[r4, o1, r0] -> y[b, (o0 o1), h, w]
}
layer odd(c0=2, c1=4, o0=4, o1=2, r0=2, r1=3, kh=3, kw=3) {
    x[b, (c0 c1), h+kh-1, w+kw-1], A[c0, kh, r0], B[c1, kw, r1], C[r0, r1, o0, o1]
        -> y[b, (o0 o1), h, w]
}
"""


def _zoo_model(tmp_path, monkeypatch, kind: str, names: tuple[str, ...] = ()
               ) -> torch.nn.Module:
    """The ZOO's layers (or those in ``names``), each followed by a ReLU."""
    torch.manual_seed(0)
    if kind == "inline":
        layers = [tnspec.Layer(net) for net in tnspec.compile_all(ZOO)
                  if not names or net.name in names]
    else:
        path = tmp_path / "zoo_layers.py"
        path.write_text(generate(ZOO))
        spec = importlib.util.spec_from_file_location("zoo_layers", path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "zoo_layers", module)  # dynamo imports it again
        spec.loader.exec_module(module)
        layers = [getattr(module, name.capitalize())()
                  for name in names or ("cp", "tucker2", "htk2", "tr", "odd")]
    return torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())])


@pytest.mark.parametrize("kind", ["inline", "generated", "inline 1x1",
                                  "inline 1x1 channels_last", "inline mm channels_last"])
def test_default_torch_compile_of_every_lowering_pattern_across_sizes(tmp_path, monkeypatch,
                                                                      kind):
    """Default torch.compile (Inductor; dynamic shapes from the second size on) of inline and
    generated layers matches eager, forward and backward, at 2 spatial and batch sizes (the
    "1x1" kinds at one). At these sizes the cost model mixes channels by a matrix product;
    "1x1" forces 1x1 convs, 1-D over the flattened axes for a contiguous input, 2-D for a
    channels-last one (on the two layers with a mixing step before and after a conv, grouped
    or not: compiling takes time); "mm" forces the product, a torch.mm of the matrix
    channels-last data is stored as.
    The inline kind, which runs the generated code (tests/test_one_executor.py) behind
    trace-time planning, compiles two layers (a plain and a grouped-mode input), the generated
    kind the other three, so that each of the five is compiled once in its default lowering;
    every layer's tracing is checked cheaply by the one-graph test."""
    torch._dynamo.reset()
    last = kind.endswith("channels_last")
    one = "1x1" in kind or "mm" in kind  # one lowering pattern, one size
    if one:
        monkeypatch.setattr(tnspec.planning.calibration, "chooser",
                            lambda *a, k=kind, **kw: lambda step: "conv1x1" if "1x1" in k
                            else "einsum")
    model = _zoo_model(tmp_path, monkeypatch, kind.split()[0],
                       ("tucker2", "htk2") if one else
                       ("cp", "tr") if kind == "inline" else ("tucker2", "htk2", "odd"))
    if kind == "generated":  # the patterns above are all there (built-in cost model)
        assert "torch.bmm(U_e, x_r)" in generate(ZOO)
    compiled = torch.compile(model)
    # Inductor's on-disk graph cache can hand one size's kernels to another shape
    # (seen with torch 2.13 even for a plain nn.Conv2d); compile afresh here
    with torch._inductor.config.patch(force_disable_caches=True):
        # a second size is compiled with dynamic shapes; a third one compiled again (the
        # backward's stride guards pin the spatial sizes), so it added time, not coverage.
        # The 1x1 kinds check one lowering pattern: one size (the others cover dynamic shapes)
        for shape in ((2, 8, 16, 16),) + (() if one else ((5, 8, 9, 7),)):
            x = torch.randn(shape)
            if last:
                x = x.contiguous(memory_format=torch.channels_last)
            model.zero_grad()
            model(x).square().sum().backward()
            eager = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
            out.square().sum().backward()
            for p, g in zip(model.parameters(), eager):
                torch.testing.assert_close(p.grad, g, rtol=1e-3, atol=1e-4)
    if "1x1" in kind:
        # compiled: 1-D over the flattened axes for a contiguous input; eagerly always 2-D
        traced = "".join(tnspec.emit.runtime.source_of(m._traced_class.forward)
                         for m in model[::2])
        eager = "".join(tnspec.emit.runtime.source_of(m._last_class.forward) for m in model[::2])
        assert ("F.conv1d" in traced) is not last and "1x1 conv" in traced
        assert "F.conv1d" not in eager and "1x1 conv" in eager
    if "mm" in kind:
        traced = "".join(tnspec.emit.runtime.source_of(m._traced_class.forward)
                         for m in model[::2])
        assert "torch.mm(" in traced


def test_a_network_of_inline_layers_compiles_to_one_graph_at_every_size():
    """Five different inline layers in one model trace as one graph, with no graph break, at
    a first size and at two later ones (dynamic shapes): the traced code finds each layer's
    class on the layer. (It once looked it up in a module-level dict that dynamo had read
    before the class was in it: every layer broke the graph and was compiled as a frame of
    its own, and past torch's recompile limit the later layers ran eagerly.)"""
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[m for net in tnspec.compile_all(ZOO)
                                  for m in (tnspec.Layer(net), torch.nn.ReLU())])
    for shape in ((2, 8, 16, 16), (3, 8, 12, 12), (5, 8, 9, 7)):
        x = torch.randn(shape)
        explained = torch._dynamo.explain(model)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
            explained.break_reasons
        torch.testing.assert_close(torch.compile(model, backend="eager")(x), model(x))


def test_the_compile_plan_is_a_dynamo_constant_and_not_made_at_construction():
    """The compile path plans at trace time, as a constant: tnspec marks the function the way
    torch._dynamo.assume_constant_result does (without importing dynamo), so this checks that
    the decorator still sets exactly that mark."""
    def probe():
        pass
    before = set(vars(probe))
    torch._dynamo.assume_constant_result(probe)
    marks = set(vars(probe)) - before
    assert marks == {"_dynamo_marked_constant"}
    assert all(getattr(tnspec.emit.runtime.compilable_key, m) for m in marks)
    assert tnspec.layer(TEXT, c=8)._classes == {}  # building planned nothing


def test_each_layer_and_each_copy_is_traced_under_a_name_of_its_own():
    """The compile path finds the layer by a name (a constant to dynamo in every torch
    release); a copy or an unpickled layer is another layer, with another name."""
    a = make()
    copies = [copy.deepcopy(a), copy.copy(a), pickle.loads(pickle.dumps(a))]
    names = [m._trace_name for m in (a, *copies)]
    assert len(set(names)) == 4
    assert all(tnspec.emit.runtime.TRACED[n] is m for n, m in zip(names, (a, *copies)))


def test_torch_export_inline_and_generated(tmp_path):
    x = torch.randn(2, 64, 8, 8)
    for module in (make(), generated(tmp_path)):
        exported = torch.export.export(module, (x,))
        assert torch.allclose(exported.module()(x), module(x), rtol=1e-5, atol=1e-6)


def test_torchscript_of_generated_module(tmp_path):
    module = generated(tmp_path)
    x = torch.randn(2, 64, 8, 8)
    assert torch.allclose(torch.jit.script(module)(x), module(x), rtol=1e-5, atol=1e-6)


def test_onnx_export_of_generated_module_runs_in_onnxruntime(tmp_path):
    pytest.importorskip("onnx", reason="the onnx package is in the test extra")
    pytest.importorskip("onnxscript", reason="torch.onnx.export needs onnxscript")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime runs the exported graph")
    module = generated(tmp_path).eval()
    x = torch.randn(2, 64, 8, 8)
    path = tmp_path / "htk2.onnx"
    torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"x": x.numpy()})
    assert torch.allclose(torch.from_numpy(y), module(x), rtol=1e-4, atol=1e-5)


def loopback_refusal() -> str | None:
    """Why TCP over 127.0.0.1 cannot work here (gloo needs it), or None when it can."""
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=5):
                pass
    except OSError as error:
        return f"no TCP over the loopback interface in this sandbox ({error})"
    return None


def _two_ranks(worker: str, folder, hang_s: int, *args: str) -> None:
    """Run ``python -m worker folder rank 2 *args`` for ranks 0 and 1; fail with both logs
    unless both exit 0 (a rank that hangs dumps its stack after ``hang_s``)."""
    ranks = [subprocess.Popen([sys.executable, "-m", worker, str(folder), str(rank), "2", *args],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(2)]
    logs = []
    for process in ranks:
        try:
            logs.append(process.communicate(timeout=hang_s + 60)[0])
        except subprocess.TimeoutExpired:
            for p in ranks:
                p.kill()
            logs.append(process.communicate()[0])
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(logs)


def test_distributed_data_parallel_keeps_ranks_identical(tmp_path):
    """Two processes (gloo) each take one step on their own batch; each rank is a fresh
    interpreter, so that nothing this test process has loaded (compilers, exporters) is
    inherited."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    if (reason := loopback_refusal()) is not None:
        pytest.skip(reason)
    _two_ranks("tests.ddp_worker", tmp_path, ddp_worker.HANG_S)
    a, b = (torch.load(tmp_path / f"{rank}.pt") for rank in range(2))
    before = torch.load(tmp_path / "init.pt")
    assert a.keys() == b.keys() == before.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert any(not torch.equal(a[k], v) for k, v in before.items())


HYPER = ("x[b, c, h+kh-1, w+kw-1], U[c, r0, phi], G[r0, r1, kh, kw, phi], V[r1, o, phi] "
         "-> y[b, o, h, w]")


@pytest.mark.parametrize("kind", ["inline", "generated"])
def test_model_to_channels_last_converts_around_a_5d_core(tmp_path, kind):
    """model.to(memory_format=torch.channels_last), the usual recipe, converts every 4-D and
    5-D tensor and raised on a 5-D core; cores now keep their layout and take the dtype."""
    sizes = dict(c=8, o=8, r0=3, r1=3, kh=3, kw=3, phi=2)
    torch.manual_seed(0)
    if kind == "inline":
        layer = tnspec.layer(HYPER, **sizes)
    else:
        path = tmp_path / "hyper_layer.py"
        path.write_text(generate(HYPER, **sizes))
        assert "def _apply(self, fn, recurse=True):" in path.read_text()
        spec = importlib.util.spec_from_file_location("hyper_layer", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        layer = module.TensorNetworkLayer()
    model = torch.nn.Sequential(layer, torch.nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(2, 8, 10, 10)
    want = model(x)
    model.to(memory_format=torch.channels_last)
    assert model[1].weight.is_contiguous(memory_format=torch.channels_last)
    assert layer.G.is_contiguous() and layer.G.shape == (3, 3, 3, 3, 2)
    torch.testing.assert_close(model(x.contiguous(memory_format=torch.channels_last)), want)
    model.to(torch.float64)
    assert layer.G.dtype == torch.float64 and isinstance(layer.G, torch.nn.Parameter)
    assert model(x.double()).dtype == torch.float64


def test_only_a_core_that_model_to_would_fail_on_gets_an_apply():
    assert "_apply" in generate(TEXT)  # HTK2's 5-D core
    assert "_apply" not in generate((EXAMPLES[0].parent / "tucker2.tn").read_text())  # 4-D


def test_a_layer_on_the_meta_device_runs_as_nn_conv2d_does():
    """Large models are built on ``meta`` before their weights are loaded: forward gives the
    output's shape there, and ``to_empty`` + ``reset_parameters`` make a real layer."""
    spec = "x[b, c, h+kh-1, w+kw-1], U[c, r0], G[r0, r1, kh, kw], V[r1, o] -> y[b, o, h, w]"
    layer = tnspec.layer(spec, c=8, o=6, r0=2, r1=2, kh=3, kw=3, device="meta")
    x = torch.empty(2, 8, 7, 7, device="meta")
    y = layer(x)
    assert y.device.type == "meta"
    assert y.shape == nn.Conv2d(8, 6, 3, padding=1, device="meta")(x).shape
    real = layer.to_empty(device="cpu")
    real.reset_parameters()
    assert real(torch.randn(2, 8, 7, 7)).shape == (2, 6, 7, 7)


@pytest.mark.parametrize("how", ["fsdp", "ddp"])
def test_training_under_fsdp2_and_ddp_matches_one_process_and_reloads(tmp_path, how):
    """Two ranks (gloo, CPU) train a tensorized model three steps under FSDP2's fully_shard
    (each tnspec layer its own unit) or DDP, on halves of one batch: the global losses are
    the single-process run's, and the model saved and loaded with torch.distributed.checkpoint
    gives the same loss again."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no gloo backend")
    if how == "fsdp" and importlib.util.find_spec("torch.distributed.fsdp") is None:
        pytest.skip("this torch build has no FSDP")
    if (reason := loopback_refusal()) is not None:
        pytest.skip(reason)
    _two_ranks("tests.fsdp_worker", tmp_path, fsdp_worker.HANG_S, how)
    found = json.loads((tmp_path / "losses.json").read_text())
    want = fsdp_worker.single_process_losses()
    assert found["losses"] == pytest.approx(want, rel=1e-5)
    assert found["losses"][-1] < found["losses"][0]  # it trained
    assert found["reloaded"] == pytest.approx(found["losses"][-1], rel=1e-6)


def _guards_from_generated_code(run) -> tuple[list[str], dict[str, int]]:
    """The symbolic-shape guards that lines of tnspec's generated code added while ``run()``
    compiled, and dynamo's graph and recompile counts."""
    import logging
    from torch._dynamo.utils import counters
    guards: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "guard added" in message and "tnspec-generated" in message:
                guards.append(message)
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    counters.clear()
    try:
        run()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return guards, {"graphs": counters["stats"]["unique_graphs"],
                    "breaks": sum(counters["graph_break"].values())}


def test_a_tensorized_network_compiles_once_per_shape_and_its_sizes_add_no_guard(monkeypatch):
    """Inductor, fullgraph: three training steps at one shape compile one graph with no
    break and no recompile; at a second size (dynamo's automatic dynamic shapes) no line of
    tnspec's code adds a guard, so tnspec's size arithmetic is plain integer work. It once
    did: a stride-2 TT layer's conv output was split into its channel modes and merged back,
    and the merge's sizes, tnspec's ``(h_in - kh) // 2 + 2`` beside the conv's own, made
    dynamo prove them equal (the ``pow_by_natural`` warnings of an H100 run)."""
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # guards come from a fresh compile
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        tnspec.formats.tucker2(16, 16, 3, rank=0.25, padding=1).layer(), nn.ReLU(),
        tnspec.formats.tt(16, 32, 3, rank=0.25, padding=1, stride=2).layer(), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    compiled = torch.compile(net, fullgraph=True)

    def steps(size: int, n: int) -> None:
        for _ in range(n):
            compiled(torch.randn(4, 3, size, size)).sum().backward()
    guards, counts = _guards_from_generated_code(lambda: steps(16, 3))
    assert counts == {"graphs": 1, "breaks": 0}
    guards, counts = _guards_from_generated_code(lambda: steps(24, 2))
    assert counts["breaks"] == 0 and guards == []
    x = torch.randn(2, 3, 20, 20)
    torch.testing.assert_close(compiled(x), net(x), rtol=1e-4, atol=1e-5)
