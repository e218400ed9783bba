"""Property tests of the workflows around the layer on small random models: nested and shared
submodules, frozen parameters, BatchNorm and Dropout, train or eval mode.

- tensorize to the ``standard`` format (one core: the dense kernel) with ``weights="fit"``,
  then merge: the model computes what it computed before, with the same modules frozen and
  the same modes;
- tensorize to a factorized format: nothing frozen becomes trainable, no mode changes, shared
  layers stay shared;
- audit leaves ``state_dict`` and the global RNG bit-identical.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import tnspec

C = 4  # channels everywhere, so that blocks compose in any order


@st.composite
def models(draw) -> nn.Module:
    """A Sequential of conv blocks (some nested, one maybe used twice, some frozen, some in
    eval mode) and a linear head."""
    blocks: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 4))):
        k = draw(st.sampled_from([1, 3]))
        conv = nn.Conv2d(C, C, k, padding=k // 2, groups=draw(st.sampled_from([1, 2])),
                         bias=draw(st.booleans()))
        extra = draw(st.sampled_from(["relu", "bn", "dropout", "none"]))
        tail = {"relu": nn.ReLU(), "bn": nn.BatchNorm2d(C), "dropout": nn.Dropout(0.2),
                "none": nn.Identity()}[extra]
        block = nn.Sequential(conv, tail) if draw(st.booleans()) else conv
        if draw(st.booleans()):
            block.requires_grad_(False)
        if draw(st.booleans()):
            block.eval()
        blocks.append(block)
        if extra != "none":
            blocks.append(tail if not isinstance(block, nn.Sequential) else nn.Identity())
    if draw(st.booleans()):
        blocks.append(blocks[0])  # a shared block: registered under two names
    head = nn.Linear(C * 5 * 5, 3)
    if draw(st.booleans()):
        head.requires_grad_(False)
    model = nn.Sequential(*blocks, nn.Flatten(), head)
    return model.train(draw(st.booleans()))


def _state(model: nn.Module) -> list[tuple[str, bool, bool]]:
    """Each parameter's name and requires_grad, and each module's mode, by name."""
    params = [(n, p.requires_grad, True) for n, p in model.named_parameters()]
    modes = [(n, m.training, False) for n, m in model.named_modules()]
    return params + modes


def _frozen(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(model=models(), seed=st.integers(0, 3))
def test_fit_to_the_standard_format_then_merge_gives_the_model_back(model, seed):
    torch.manual_seed(seed)
    x = torch.randn(2, C, 5, 5)
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = reference(x)
    before = _state(model)
    tensorized, report = tnspec.tensorize(copy.deepcopy(model), "standard", weights="fit")
    assert all(r.fit_error is not None and r.fit_error < 1e-5 for r in report.replaced)
    merged = tnspec.merge(tensorized)
    assert _state(merged) == before
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(x), want, rtol=1e-4, atol=1e-5)


@SETTINGS
@given(model=models(), fmt=st.sampled_from(["cp", "tucker2", "tt"]))
def test_tensorize_keeps_frozen_parameters_modes_and_shared_layers(model, fmt):
    frozen_modules = {n for n, m in model.named_modules()
                      if isinstance(m, (nn.Conv2d, nn.Linear)) and not m.weight.requires_grad}
    modes = {n: m.training for n, m in model.named_modules()}
    shared = {id(m) for _, m in model.named_modules(remove_duplicate=False)}
    tensorized, _ = tnspec.tensorize(model, fmt, rank=0.5, weights="fit")
    names = dict(tensorized.named_modules())
    for name in frozen_modules:
        assert not any(p.requires_grad for n, p in names[name].named_parameters()
                       if n != "bias"), name
    for name, training in modes.items():
        if name in names:
            assert names[name].training == training, name
    assert len({id(m) for _, m in tensorized.named_modules(remove_duplicate=False)}) <= \
        len(shared)  # no shared module was split in two
    tensorized(torch.randn(2, C, 5, 5))


@SETTINGS
@given(model=models(), backward=st.booleans())
def test_audit_leaves_the_state_dict_and_the_rng_bit_identical(model, backward):
    x = torch.randn(3, C, 5, 5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    grads = [p.grad for p in model.parameters()]
    rng = torch.get_rng_state()
    tnspec.audit(model, x, backward=backward)
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert state.keys() == after.keys()
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert [m.training for m in model.modules()] == modes
    assert [p.grad for p in model.parameters()] == grads
