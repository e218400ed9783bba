"""Sensitivities measured with the blocks before a layer replayed from the unperturbed run are
the ones full runs give, to the bit; blocks that might act differently are run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tnspec
from tnspec.workflows.convert import observe, replay

from ..model_state import snapshot, unchanged


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True),
                                   nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


class Doubling(nn.Module):
    """Writes into its input: replaying it would leave the input as it was."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


class Noted(nn.Module):
    """Takes a list it appends to: a call whose effect is more than its output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, notes: list) -> torch.Tensor:
        notes.append(x.sum())
        return self.linear(x)


class Net(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual(width) for _ in range(3)])
        self.shared = nn.Linear(width, width)
        self.noted = nn.ModuleList([Noted(width)])
        self.tail = nn.Sequential(Doubling(), nn.Linear(width, width), nn.Tanh(),
                                  nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        notes: list = []
        x = self.shared(x)
        for block in self.blocks:
            x = block(x)
        x = self.shared(x)  # called twice: not one value of the run
        x = self.noted[0](x, notes)
        return self.tail(x) + 0 * sum(notes)


def layers_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def measured(model: nn.Module, data: list, budget: int | None = None, **kw) -> dict:
    if budget is None:
        return observe.sensitivities(model, layers_of(model), data, **kw)
    before = replay.MAX_BYTES
    replay.MAX_BYTES = budget
    try:
        return observe.sensitivities(model, layers_of(model), data, **kw)
    finally:
        replay.MAX_BYTES = before


def counting(module: nn.Module) -> list[int]:
    count = [0]
    original = module.forward

    def forward(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)
    module.forward = forward
    return count


def test_replayed_blocks_give_the_full_runs_sensitivities_to_the_bit():
    torch.manual_seed(0)
    model = Net()
    data = [torch.randn(5, 8) for _ in range(3)]
    full = measured(model, data, budget=0)  # nothing recorded: every run runs everything
    first = counting(model.blocks[0].inner[0])
    assert measured(model, data) == full
    # the first linear of block 0 ran for the references (3) and for the runs of the shared
    # linear and its own (2 x 3); the other 8 layers' 24 runs replayed it (its block's
    # second linear replays it alone, the later layers the whole block)
    assert first[0] == 3 + 2 * 3


def test_a_block_that_writes_its_input_takes_a_list_or_runs_twice_is_not_replayed():
    torch.manual_seed(0)
    model = Net()
    names = dict((id(m), n) for n, m in model.named_modules())
    with torch.no_grad(), replay.recording(model, dict(layers_of(model))) as rec:
        model(torch.randn(5, 8))
    replayed = {names[k] for k, c in rec.calls.items() if c.replayable}
    assert {"tail.0", "noted.0"}.isdisjoint(replayed)  # in place; a list argument
    assert "blocks.2" in replayed and "tail.1" in replayed
    last = {names[id(c.module)] for c in rec.before("tail.3")}
    assert last == {"blocks.0", "blocks.1", "blocks.2", "tail.1", "tail.2"}
    # shared is not a block; the first layer has nothing before it
    assert rec.before("shared") == [] and rec.before("blocks.0.inner.0") == []
    # inside a replayable block only what a layer entered later inside it replays is kept
    kept = {names[k] for k, c in rec.calls.items() if c.output is not None}
    assert "blocks.0.inner.0" in kept and "blocks.0.inner.2" not in kept
    assert rec.bytes == sum(replay._size(c.output) for c in rec.calls.values())


def test_the_replay_keeps_no_more_than_its_budget_and_still_measures_alike():
    torch.manual_seed(0)
    model = Net(width=16)
    data = [torch.randn(4, 16) for _ in range(2)]
    one_block = 4 * 16 * 4  # a block's output: 4 x 16 float32
    with torch.no_grad(), replay.recording(model, dict(layers_of(model)), one_block) as rec:
        model(data[0])
    assert rec.bytes <= one_block
    assert measured(model, data, budget=one_block) == measured(model, data, budget=0)


def test_compress_that_raises_inside_a_replayed_run_leaves_the_model_as_it_was():
    """Values, requires_grad, structure, ties hashed around the failing call; no block left
    answering from the recording, no hook left."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                          nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 8))
    model[2].weight = model[0][0].weight  # tied
    model[1][0].bias.requires_grad_(False)
    before = snapshot(model)
    seen: list[bool] = []

    def fails(module, args):  # 2 input-recording runs, 2 references, then the layer's 2
        seen.append("forward" in model[0].__dict__)  # (the tied ones are left alone)
        if len(seen) == 5:  # block 1's linear's first run: block 0 is replayed
            raise RuntimeError("stop")
    handle = model[2].register_forward_pre_hook(fails)
    with pytest.raises(RuntimeError, match="stop"):
        tnspec.compress(model, 0.5, data=[torch.randn(5, 8) for _ in range(2)])
    handle.remove()
    assert seen[-1] and not any(seen[:-1])  # it raised while block 0 replayed, and only then
    assert unchanged(before, model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_hugging_face_models_measure_alike_with_dict_batches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=3, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=64,
                                     max_position_embeddings=16)
    bert = transformers.BertModel(config).eval()
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(1, 64, (3, 9), generator=gen),
             "attention_mask": torch.ones(3, 9, dtype=torch.long)} for _ in range(2)]
    full = measured(bert, data, budget=0)
    first = counting(bert.encoder.layer[0].attention.self.query)
    assert measured(bert, data) == full
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    tokens = [torch.randint(1, 64, (2, 7), generator=gen)]
    gpt_layers = [(n, m) for n, m in gpt2.named_modules() if n.endswith(("c_attn", "c_fc"))]
    assert observe.sensitivities(gpt2, gpt_layers, tokens) == \
        measured_without_replay(gpt2, gpt_layers, tokens)
    # the first encoder layer ran for the references and its own 6 linears' runs only
    assert first[0] == 2 * (1 + 6) < 2 * (1 + len(layers_of(bert)))


def measured_without_replay(model: nn.Module, layers: list, data: list) -> dict:
    before = replay.MAX_BYTES
    replay.MAX_BYTES = 0
    try:
        return observe.sensitivities(model, layers, data)
    finally:
        replay.MAX_BYTES = before


class Aliasing(nn.Module):
    """``out + h`` where an in-place ReLU after an identity wrote through to ``h``: replaying
    the identity with a copy would leave ``h`` as it was."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.seq = nn.Sequential(nn.Dropout(0.5), nn.ReLU(inplace=True), nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.seq(h) + h


def test_a_block_that_returns_its_input_is_run_so_in_place_ops_write_through_as_before():
    torch.manual_seed(0)
    model = Aliasing().eval()  # Dropout returns its input
    data = [torch.randn(5, 8) for _ in range(2)]
    with torch.no_grad(), replay.recording(model, dict(layers_of(model))) as rec:
        model(data[0])
    names = dict((id(m), n) for n, m in model.named_modules())
    assert {names[k] for k, c in rec.calls.items() if c.replayable} == {"seq.2"}
    assert measured(model, data) == measured(model, data, budget=0)


def test_a_block_with_a_forward_hook_is_run_so_the_hook_changes_its_output_once():
    torch.manual_seed(0)
    model = Net().eval()
    data = [torch.randn(5, 8) for _ in range(2)]
    handle = model.blocks[0].register_forward_hook(lambda m, args, out: out * 2)
    try:
        with torch.no_grad(), replay.recording(model, dict(layers_of(model))) as rec:
            model(data[0])
        assert not rec.calls[id(model.blocks[0])].replayable
        assert rec.calls[id(model.blocks[1])].replayable
        assert measured(model, data) == measured(model, data, budget=0)
    finally:
        handle.remove()
