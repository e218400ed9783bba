"""tnspec.hotswap: another adapter's values into a compiled model, with no compile again."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tnspec

from ..model_state import snapshot, unchanged


def _base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 6 * 6, 5), nn.Tanh(), nn.Linear(5, 3))


def _trained(fmt: str, seed: int, scale: float = 1.0, name: str = "default",
             base: nn.Module | None = None, step_rule: str | None = None,
             init: str = "zero") -> nn.Module:
    """The base with adapter ``name`` of ``fmt``, its cores drawn at random (trained), and the
    head trained in full."""
    model, _ = tnspec.adapt(copy.deepcopy(base or _base()), fmt, rank=0.5, scale=scale,
                            name=name, modules_to_save=["5"], step_rule=step_rule, init=init)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.5)
    return model


class Counting:
    """A torch.compile backend that counts the graphs it is given (each compile, or
    recompile, of a frame hands it one)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> object:
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("fmt, rule, init", [("tt", None, "zero"), ("cp", None, "zero"),
                                             ("tr", "spectral", "zero"),
                                             ("tt_lora", "spectral", "offset")])
def test_a_compiled_model_runs_the_swapped_adapter_without_compiling_again(fmt, rule, init):
    torch._dynamo.reset()
    model = _trained(fmt, seed=1, step_rule=rule, init=init)
    other = _trained(fmt, seed=2, scale=3.0, step_rule=rule, init=init)
    assert model[0].scaling["default"] != other[0].scaling["default"]  # the fold is used
    x = torch.randn(2, 4, 6, 6)
    backend = Counting()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        before = compiled(x)
        graphs = backend.graphs
        tnspec.hotswap(model, tnspec.adapter_state_dict(other), tnspec.adapter_config(other))
        after = compiled(x)
        want = other(x)
    assert backend.graphs == graphs, "hotswap made torch.compile compile again"
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)  # eager, too
    # set_adapter, by contrast, changes what runs: torch.compile compiles the new choice
    tnspec.adapt(model, fmt, rank=0.5, name="second")
    with torch.no_grad():
        compiled(x)
    assert backend.graphs > graphs


def test_hotswap_takes_a_named_saved_adapter_into_a_named_one():
    base = _base()
    model = _trained("tt", seed=1, name="a", base=base)
    tnspec.adapt(model, "tt", rank=0.5, name="b")
    other = _trained("tt", seed=2, name="x", base=base)
    tnspec.adapt(other, "low_rank", rank=0.5, name="y")  # active when saved: not swapped in
    state, config = tnspec.adapter_state_dict(other), tnspec.adapter_config(other)
    x = torch.randn(2, 4, 6, 6)
    tnspec.hotswap(model, state, config, name="x", into="a")
    tnspec.set_adapter(model, "a")
    tnspec.set_adapter(other, "x")
    torch.testing.assert_close(model(x), other(x), rtol=1e-5, atol=1e-6)


def test_what_hotswap_cannot_write_is_refused_and_the_model_stays_as_it_was():
    model, x = _trained("tt", seed=1), torch.randn(2, 4, 6, 6)
    before = snapshot(model)
    other = _trained("cp", seed=2)
    state, config = tnspec.adapter_state_dict(other), tnspec.adapter_config(other)
    with pytest.raises(tnspec.SpecError, match=r"layer '0': the saved adapter's network is"):
        tnspec.hotswap(model, state, config)
    same = _trained("tt", seed=2)
    state, config = tnspec.adapter_state_dict(same), tnspec.adapter_config(same)
    del config["layers"]["3"]
    with pytest.raises(tnspec.SpecError, match=r"layer '3' holds adapter 'default', but the "
                                               r"saved adapters do not name it"):
        tnspec.hotswap(model, state, config)  # '0' was checked first: nothing written
    config = tnspec.adapter_config(same)
    with pytest.raises(tnspec.SpecError, match=r"core .* is missing in the saved state"):
        tnspec.hotswap(model, {k: v for k, v in state.items() if not k.startswith("3.")},
                       config)
    with pytest.raises(tnspec.SpecError, match=r"no layer of the model holds adapter 'nope'"):
        tnspec.hotswap(model, state, config, into="nope")
    with pytest.raises(tnspec.SpecError, match=r"have no adapter 'nope'"):
        tnspec.hotswap(model, state, config, name="nope")
    with pytest.raises(tnspec.SpecError, match=r"needs the config saved with"):
        tnspec.hotswap(model, state, {})
    assert unchanged(before, model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _trained("tt", seed=1)(x))
