"""``keep_built``: a layer that asks builds the weights its forward makes of the cores alone
once, while no core needs a gradient, and builds them again whenever a core changes. Frozen
copies of adapters ask (the default ``adapt`` start runs one beside every adapter)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import tnspec

from .test_dispatch import Count


def kernel_first(seed: int = 0, **options) -> tnspec.Layer:
    """A TT conv whose plan builds the dense kernel from the three cores, then convolves."""
    torch.manual_seed(seed)
    return tnspec.formats.build("tt", 16, 16, 3, padding=1, rank=0.2).layer(
        planner="dense-first", autotune=False, **options)


def ops(layer: nn.Module, x: torch.Tensor) -> dict[str, int]:
    with Count() as counted:
        layer(x)
    return dict(counted.ops)


X = torch.randn(2, 16, 8, 8)


def test_a_frozen_layer_that_keeps_builds_once_and_computes_the_same_bits():
    plain, kept = kernel_first().requires_grad_(False), kernel_first().requires_grad_(False)
    kept.keep_built = True
    first = kept(X)
    assert torch.equal(first, plain(X))
    assert ops(kept, X) == {"convolution": 1}  # the kernel is not built again
    assert "mm" in ops(plain, X)  # the default: built at every call
    assert torch.equal(kept(X), first)
    assert "_kept" not in plain.__dict__


def test_what_is_kept_is_built_again_when_a_core_changes():
    reference, kept = kernel_first().requires_grad_(False), kernel_first().requires_grad_(False)
    kept.keep_built = True
    kept(X)

    def same() -> bool:
        return torch.equal(kept(X), reference(X))
    with torch.no_grad():  # in place
        for layer in (kept, reference):
            layer.A.mul_(2)
    assert same()
    other = kernel_first(seed=1).state_dict()  # load_state_dict copies into the cores
    for layer in (kept, reference):
        layer.load_state_dict(other)
    assert same()
    new = torch.randn_like(kept.B)
    for layer in (kept, reference):  # a core replaced
        layer.B = nn.Parameter(new.clone(), requires_grad=False)
    assert same()
    for layer in (kept, reference):  # converted: the cores' storage is new
        layer.double()
    assert kept(X.double()).dtype == torch.float64
    assert torch.equal(kept(X.double()), reference(X.double()))


def test_a_core_that_trains_is_built_at_every_step_and_gets_its_gradient():
    plain, kept = kernel_first(), kernel_first()
    kept.keep_built = True
    for layer in (plain, kept):
        layer(X).square().sum().backward()
    for a, b in zip(plain.parameters(), kept.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert "_kept" not in kept.__dict__
    # under no_grad (an evaluation between steps) it is kept, and a step makes it stale
    with torch.no_grad():
        before = kept(X)
    assert "_kept" in kept.__dict__
    torch.optim.SGD(kept.parameters(), lr=0.1).step()
    with torch.no_grad():
        after = kept(X)
    assert not torch.equal(after, before)
    reference = kernel_first().requires_grad_(False)
    reference.load_state_dict(kept.state_dict())
    assert torch.equal(after, reference(X))


def test_weights_kept_under_inference_mode_are_not_saved_for_a_backward():
    """Inference tensors cannot be saved for backward: what inference mode built is built
    again for a call whose input needs a gradient."""
    layer = kernel_first().requires_grad_(False)
    layer.keep_built = True
    with torch.inference_mode():
        layer(X)
    x = X.clone().requires_grad_(True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_copies_do_not_carry_what_was_kept():
    layer = kernel_first().requires_grad_(False)
    layer.keep_built = True
    layer(X)
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert "_kept" not in twin.__dict__ and twin.keep_built
        assert torch.equal(twin(X), layer(X))


def test_a_generated_module_keeps_alike_and_still_scripts(tmp_path):
    layer = kernel_first().requires_grad_(False)
    params = ", ".join(f"{k}={v}" for k, v in layer.sizes.items())
    source = tnspec.generate(f"layer tt({params}) {{\n  {layer.spec}\n}}\n")
    module = tnspec.emit.runtime.load_class(source, "Tt")()
    module.load_state_dict(layer.state_dict())
    module.requires_grad_(False)
    assert module.keep_built is False
    reference = module(X)
    module.keep_built = True
    module(X)
    assert ops(module, X).get("mm", 0) == 0 and torch.equal(module(X), reference)
    scripted = torch.jit.script(module)
    torch.testing.assert_close(scripted(X), reference)


def test_compiled_it_builds_in_the_graph_with_no_recompile():
    from torch._dynamo.utils import counters
    layer = kernel_first().requires_grad_(False)
    layer.keep_built = True
    eager = layer(X)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(X), eager)
    with torch.no_grad():
        layer.A.mul_(2)
    torch.testing.assert_close(compiled(X), layer(X))
    compiled(X)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()


def default_and_zero_step_ops(fmt: str) -> tuple[dict, dict, nn.Module]:
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    counts = {}
    for init in ("zero", "offset"):
        model, _ = tnspec.adapt(nn.Sequential(nn.Linear(64, 64)), fmt, rank=0.2, init=init)
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)
        g = torch.randn(16, 64)
        with Count() as counted:
            model(x).backward(g)
        counts[init] = counted.ops
    return counts["offset"], counts["zero"], model


@pytest.mark.parametrize("fmt", ["tr", "tt_lora"])
def test_the_default_adapter_start_builds_its_frozen_copy_once(fmt):
    """The frozen copy a default ``adapt`` start subtracts builds its factor matrices once:
    a training step dispatches what the zero start does plus the frozen copy's contraction
    with the data and one subtraction, and not one op that builds a weight."""
    offset, zero, model = default_and_zero_step_ops(fmt)
    extra = offset - zero
    frozen = model[0].offsets["default"]
    assert frozen.keep_built and "_kept" in frozen.__dict__
    assert not zero - offset and extra["sub"] == 1
    assert not {"permute", "clone", "_unsafe_view"} & set(extra), dict(extra)


def test_where_one_weight_meets_the_data_the_default_start_costs_one_subtraction():
    """TT on a linear builds the dense weight, then one F.linear: the adapter less its frozen
    copy is that F.linear with the difference of the two weights."""
    offset, zero, _ = default_and_zero_step_ops("tt")
    assert dict(offset - zero) == {"sub": 1} and not zero - offset


@pytest.mark.parametrize("fmt", ["tt", "tr"])
def test_the_difference_of_weights_computes_what_the_two_layers_did(fmt):
    """Exact at init without autograd, and after training the adapter less its copy, as the
    two layers run one after the other compute it (to float rounding)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64))
    model, _ = tnspec.adapt(base, fmt, rank=0.2)
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert torch.equal(model(x), model[0].base(x))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    adapted = model[0]
    adapter, frozen = adapted.adapters["default"], adapted.offsets["default"]
    want = adapted.base(x) + adapted.scaling["default"] * (adapter(x) - frozen(x))
    got = model(x)
    assert "_minus" not in adapter.__dict__
    assert (want - adapted.base(x)).abs().max() > 1e-3  # it trained
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(model)(x), want, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
