"""Random sequences of workflows on small random models (hypothesis' stateful testing): adapt,
set_adapter, a training step, tensorize, compress, merge, merge_adapters, saving and loading
adapters, deepcopy and, in the long profile, torch.compile. After every step:

- a step that raised left the model exactly as it was (parameters, flags, buffers, structure,
  active adapters: ``model_state``);
- outputs are equal where the workflow promises it (adapt at init, merge, merge_adapters, a
  reload of saved adapters, a standard-format fit, deepcopy, compile);
- a frozen base stays frozen: tensorize, compress and merges make no base parameter trainable;
- the embedding tied to the language model's head keeps its values while the tie holds
  (nothing merges into a tied tensor).

The suite runs a bounded profile (under a minute); ``TNSPEC_FUZZ=long`` runs a longer one, with
torch.compile steps::

    TNSPEC_FUZZ=long python -m pytest tests/workflows/test_fuzz_sequences.py
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

import tnspec

from ..model_state import snapshot, unchanged

LONG = os.environ.get("TNSPEC_FUZZ") == "long"
NAMES = ("a", "b")  # adapter names: a second adapt under one of them must be refused
FAST_FIT = {"max_iter": 5, "max_seconds": 5}


class TinyLM(nn.Module):
    """Token embedding -> two linear layers -> a head tied to the embedding."""

    def __init__(self, vocab: int = 12, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.out(torch.tanh(self.hidden(self.embed(ids)))))


class _SameConv(nn.Conv2d):
    """TensorFlow's "same" padding made in forward (timm's ``Conv2dSame``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for n, k, s, d in zip(reversed(x.shape[-2:]), reversed(self.kernel_size),
                              reversed(self.stride), reversed(self.dilation)):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads += [total // 2, total - total // 2]
        return F.conv2d(F.pad(x, pads), self.weight, self.bias, self.stride, 0, self.dilation,
                        self.groups)


class _StdConv(nn.Conv2d):
    """A weight standardized in forward (BiT's ``StdConv2d``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v, m = torch.var_mean(self.weight, dim=[1, 2, 3], keepdim=True, unbiased=False)
        return self._conv_forward(x, (self.weight - m) / torch.sqrt(v + 1e-10), self.bias)


@st.composite
def cnns(draw) -> nn.Module:
    """Two convs of random geometry (stride, padding and its mode, dilation, groups; or a
    subclass padding "same" or standardizing its weight in forward) and a linear head."""
    stride, dilation = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["zeros", "reflect", "same", "standardized"]))
    if kind == "same":
        first = _SameConv(4, 4, 3, stride=stride, dilation=dilation, groups=groups)
        size = -(-8 // stride)
    else:
        cls = _StdConv if kind == "standardized" else nn.Conv2d
        first = cls(4, 4, 3, stride=stride, padding=dilation, dilation=dilation,
                    groups=groups, padding_mode="reflect" if kind == "reflect" else "zeros")
        size = (8 + 2 * dilation - 2 * dilation - 1) // stride + 1
    second = nn.Conv2d(4, 4, 1)
    return nn.Sequential(first, nn.ReLU(), second, nn.Flatten(), nn.Linear(4 * size * size, 3))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


class Workflows(RuleBasedStateMachine):
    """One model, changed by one workflow a step."""

    @initialize(kind=st.sampled_from(["lm", "cnn"]), cnn=cnns(), frozen=st.booleans(),
                seed=st.integers(0, 3))
    def build(self, kind: str, cnn: nn.Module, frozen: bool, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = TinyLM() if kind == "lm" else cnn
        self.x = torch.randint(0, 12, (3, 5)) if kind == "lm" else torch.randn(2, 4, 8, 8)
        if frozen:
            self.model.requires_grad_(False)
        self.frozen_base = frozen
        self.embedding = self.model.embed.weight.detach().clone() if kind == "lm" else None

    # ---- helpers ------------------------------------------------------------------------------

    def out(self, model: nn.Module | None = None) -> torch.Tensor:
        with torch.no_grad():
            return (model or self.model).eval()(self.x)

    def attempt(self, step, promise_same_output: bool) -> None:
        """Run ``step(model) -> model``; an error must leave the model as it was, and a
        step promising equal outputs must keep them."""
        before, want = snapshot(self.model), self.out()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                new = step(self.model)
        except tnspec.SpecError:
            assert unchanged(before, self.model), "a workflow that raised changed the model"
            return
        self.model = new
        if promise_same_output:
            assert _close(self.out(), want), step

    def adapters(self) -> list[tnspec.Adapted]:
        return [m for m in self.model.modules() if isinstance(m, tnspec.Adapted)]

    # ---- rules ------------------------------------------------------------------------------

    @rule(fmt=st.sampled_from(["low_rank", "cp", "tucker2", "tt", "tr"]),
          name=st.sampled_from(NAMES), rank=st.sampled_from([1, 2, 0.5, 0]),  # 0: refused
          step_rule=st.sampled_from([None, "spectral"]),
          init=st.sampled_from([None, "zero", "offset", "principal"]))
    def adapt(self, fmt: str, name: str, rank: float, step_rule: str | None,
              init: str | None) -> None:
        # the new adapter adds nothing at init (None: adapt's default start) and becomes the
        # active one: the outputs stay where none was
        active = any(m.active for m in self.adapters())
        given = {} if init is None else {"init": init}
        self.attempt(lambda m: tnspec.adapt(m, fmt, rank=rank, name=name, step_rule=step_rule,
                                            **given)[0], not active)

    @rule(name=st.sampled_from(NAMES + ("typo",)))
    def set_adapter(self, name: str) -> None:
        def step(m: nn.Module) -> nn.Module:
            tnspec.set_adapter(m, name)
            return m
        self.attempt(step, False)

    @precondition(lambda self: any(m.active for m in self.adapters()))
    @rule(seed=st.integers(0, 9))
    def train_step(self, seed: int) -> None:
        """What training does to the active adapters: moves every trainable core."""
        torch.manual_seed(seed)
        with torch.no_grad():
            for m in self.adapters():
                if m.active:
                    for p in m.adapters[m.active].parameters():
                        p.add_(0.3 * torch.randn_like(p))

    @rule(fmt=st.sampled_from(["standard", "cp", "tucker2"]))
    def tensorize(self, fmt: str) -> None:
        fit = fmt == "standard"  # one core holding the dense kernel: the same outputs
        self.attempt(lambda m: tnspec.tensorize(m, fmt, rank=0.5,
                                                weights="fit" if fit else "init")[0], fit)

    @rule(sequential=st.booleans(), heal=st.sampled_from([0, 3]),
          latency=st.sampled_from([False, True, "training"]), slow=st.integers(0, 3))
    def compress(self, sequential: bool, heal: int, latency: bool | str, slow: int) -> None:
        def timer(module: nn.Module, shape: tuple[int, ...]) -> float:
            # a clock of no machine: a tnspec layer slower than dense by turns, at a batch
            return 1.0 + (isinstance(module, tnspec.Layer) and (shape[0] + slow) % 2)
        self.attempt(lambda m: tnspec.compress(m, 0.6, ("cp",), shares=(0.3,), fit=FAST_FIT,
                                               data=self.x, sequential=sequential,
                                               heal=heal, latency=latency,
                                               timer=timer if latency else None)[0], False)

    @rule()
    def merge(self) -> None:
        self.attempt(tnspec.merge, True)

    @rule(inplace=st.booleans())
    def merge_adapters(self, inplace: bool) -> None:
        self.attempt(lambda m: tnspec.merge_adapters(m, inplace=inplace), True)

    @precondition(lambda self: any(m.adapters for m in self.adapters()))
    @rule()
    def save_and_load(self) -> None:
        """The adapters saved, then loaded onto a copy: they replace the copy's own."""
        state = copy.deepcopy(tnspec.adapter_state_dict(self.model))
        config = tnspec.adapter_config(self.model)
        self.attempt(lambda m: tnspec.load_adapters(copy.deepcopy(m), state, config), True)

    @rule()
    def deepcopy(self) -> None:
        self.attempt(copy.deepcopy, True)

    @precondition(lambda self: LONG)
    @rule()
    def compile(self) -> None:
        torch._dynamo.reset()
        with torch.no_grad():
            assert _close(torch.compile(self.model)(self.x), self.out())

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def frozen_base_stays_frozen(self) -> None:
        if getattr(self, "frozen_base", False):
            adapter_params = {id(p) for m in self.adapters() for p in m.adapters.parameters()}
            assert not any(p.requires_grad for p in self.model.parameters()
                           if id(p) not in adapter_params)

    @invariant()
    def a_tied_embedding_keeps_its_values(self) -> None:
        """While the head is tied to it, whatever happens to the head. An adapter merged into
        the head unties them (with a warning); from then on the embedding is a layer like any
        other, which tensorize may re-initialize."""
        if getattr(self, "embedding", None) is None:
            return
        embed = getattr(self.model, "embed", None)
        weight = getattr(embed, "weight", None)
        if not isinstance(weight, torch.Tensor):  # tensorized, its head reading the new table
            self.embedding = None
            return
        tied = any(p is weight for m in self.model.modules() if m is not embed
                   for p in m._parameters.values())
        if not tied:
            self.embedding = None
            return
        assert torch.equal(weight, self.embedding)

    @invariant()
    def model_runs(self) -> None:
        if hasattr(self, "model"):
            assert torch.isfinite(self.out()).all()


Workflows.TestCase.settings = settings(
    max_examples=200 if LONG else 60, stateful_step_count=20 if LONG else 12, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_workflow_sequences = Workflows.TestCase
