"""CUDA correctness: the zoo against the dense reference, generated code, calibration and
autotuning on the GPU, torch.compile across sizes. Skipped where no CUDA device is present.
(Autocast on CUDA: test_autocast.py; fitting on CUDA: test_decompose.py.)"""

from __future__ import annotations

import pytest
import torch

import tnspec
from tnspec.planning import calibration, measure

from ..generated import compare, load
from ..zoo import FORMATS, spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TWO_D = [(fmt, stride) for fmt in FORMATS for stride in (1, 2)]
TUCKER2 = "x[b, c, h+kh-1, w+kw-1], U[c, r0], G[r0, r1, kh, kw], V[r1, o] -> y[b, o, h, w]"
SIZES = dict(c=16, o=12, r0=4, r1=5, kh=3, kw=3)


@pytest.mark.parametrize("mixing", ["conv1x1", "einsum"])
@pytest.mark.parametrize("fmt, stride", TWO_D, ids=[f"{f}-s{s}" for f, s in TWO_D])
def test_zoo_on_cuda_matches_the_dense_reference(fmt, stride, mixing, monkeypatch):
    """float64 on the GPU, forward and backward, in both layouts and run channels-last
    inside, each way of mixing channels (cuDNN's float64 kernels are exact to rounding, as on
    the CPU)."""
    monkeypatch.setattr(calibration, "chooser", lambda *a, **k: lambda step: mixing)
    text, sizes, shape = spec(fmt, 2, stride, "same", 1)
    torch.manual_seed(0)
    module = tnspec.layer(text, dtype=torch.float64, device="cuda", **sizes)
    with torch.no_grad():
        if module.bias is not None:
            module.bias.normal_()
    x = torch.randn(2, *shape, dtype=torch.float64, device="cuda")
    compare(module, x)
    compare(module, x.contiguous(memory_format=torch.channels_last))
    # the autotuner's candidate that runs a contiguous input channels-last inside
    cls = tnspec.emit.runtime.layer_class(module.network, module.plan(x.shape), convert=True)
    monkeypatch.setattr(module, "_class", lambda shape, channels_last=False: cls)
    compare(module, x)


def test_generated_code_on_cuda_equals_the_inline_layer(tmp_path):
    inline = tnspec.layer(TUCKER2, device="cuda", **SIZES)
    module = load(tnspec.generate(TUCKER2, **SIZES), tmp_path, "on_cuda")
    generated = [v for k, v in vars(module).items() if isinstance(v, type) and
                 issubclass(v, torch.nn.Module) and v.__module__ == module.__name__][0]()
    generated.load_state_dict(inline.state_dict())
    generated.cuda()
    x = torch.randn(4, 16, 10, 10, device="cuda")
    with torch.backends.cudnn.flags(allow_tf32=False):
        torch.testing.assert_close(generated(x), inline(x), rtol=1e-5, atol=1e-5)


def test_calibration_and_autotuning_on_cuda(calibrated, monkeypatch):
    """Calibration measures the GPU and is cached under its name; the autotuned layer computes
    what the model's order computes and leaves both random generators alone, under
    ``inference_mode`` and with frozen cores too. The GPU is measured for real (the fixture's
    idle samples stand in for a CPU that CI keeps busy)."""
    monkeypatch.setattr(calibration, "measure", measure.measure)
    found = tnspec.calibrate("cuda")
    assert found.key.startswith(f"cuda {torch.cuda.get_device_name()}") and calibrated.exists()
    assert found.model.conv_rate > 0
    for context in (torch.enable_grad, torch.inference_mode):
        layer = tnspec.layer(TUCKER2, device="cuda", **SIZES)
        layer.requires_grad_(context is torch.enable_grad)
        x = torch.randn(8, 16, 12, 12, device="cuda")
        cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state()
        with context(), torch.backends.cudnn.flags(allow_tf32=False):
            y = layer(x)
            want = layer._planned(tuple(x.shape)).forward(layer, x)
        assert torch.equal(torch.get_rng_state(), cpu)
        assert torch.equal(torch.cuda.get_rng_state(), gpu)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert any(c.key == found.key for c in calibration.cached())


def test_default_torch_compile_on_cuda_across_sizes():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(tnspec.layer(TUCKER2, **SIZES), torch.nn.ReLU(),
                                tnspec.layer(TUCKER2, **{**SIZES, "c": 12})).cuda()
    compiled = torch.compile(model)
    with torch.backends.cudnn.flags(allow_tf32=False):
        for shape in ((2, 16, 16, 16), (2, 16, 12, 12), (3, 16, 20, 20)):
            x = torch.randn(shape, device="cuda")
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_torch_compile_with_cuda_graphs_equals_eager():
    """``mode="reduce-overhead"`` (CUDA graphs, which remove the launch overhead that small
    factorized layers are bound by on a GPU) records and replays the traced class."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = tnspec.layer(TUCKER2, **SIZES).cuda()
    compiled = torch.compile(layer, mode="reduce-overhead")
    with torch.backends.cudnn.flags(allow_tf32=False):
        for _ in range(4):  # warm-up, recording, replays
            x = torch.randn(4, 16, 12, 12, device="cuda")
            torch.testing.assert_close(compiled(x).clone(), layer(x), rtol=1e-4, atol=1e-4)
