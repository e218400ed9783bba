"""Decomposition: Layer.fit_ (ALS for any network), tensorize(weights="fit"), merge."""

import copy
import doctest
import io
import sys

import pytest
import torch
from torch import nn

import tnspec
from tnspec import formats
from tnspec.fit import als, decompose
from tnspec.ir import without_units
from tnspec.workflows.convert import merge, tensorize


def _instance(fmt: formats.Format, seed: int, noise: float = 0.005,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense weight of a random instance of ``fmt`` plus relative Gaussian noise."""
    torch.manual_seed(seed)
    weight = fmt.layer(dtype=dtype).dense_weight().detach()
    return weight + noise * weight.std() * torch.randn_like(weight)


def _true_error(layer: tnspec.Layer, weight: torch.Tensor) -> float:
    """The relative error from the layer's dense weight (test_formats checks that weight
    against F.conv on the layer's own outputs), in float64."""
    w = layer.dense_weight().detach().double()
    return float(torch.linalg.norm(w - weight.double()) / torch.linalg.norm(weight.double()))


@pytest.mark.parametrize("name, starts", [
    ("cp", 1), ("tucker2", 1), ("tt", 1), ("tr", 1), ("tucker", 1), ("hypernet", 1),
    ("low_rank", 1), ("htk2", 12), ("block_term", 4)])
def test_fit_recovers_a_noisy_instance_of_the_same_network(name, starts):
    fmt = formats.build(name, 16, 24, 3, padding=1, rank=0.2)
    weight = _instance(fmt, seed=0)
    layer = fmt.layer()
    error = layer.fit_(weight, starts=starts)
    assert error < 0.02  # the noise is 0.5%
    assert error == pytest.approx(_true_error(layer, weight), rel=1e-6)


def test_basin_hops_recover_the_odd_network_where_one_start_stalls():
    # 9 cores in loops: ALS from one start stops at 0.20 here; redrawing a few cores of the
    # best fit and sweeping again reaches the noise
    fmt = formats.build("odd", 16, 16, 3, padding=1, rank=0.2)
    weight = _instance(fmt, seed=0)
    assert fmt.layer().fit_(weight, starts=1, hops=0, max_seconds=None) > 0.1
    layer = fmt.layer()
    # no time limit: on a loaded machine the default 60 s cut the hops short (a test must
    # not depend on the clock)
    error = layer.fit_(weight, starts=1, hops=8, max_seconds=None)
    assert error < 0.02
    assert error == pytest.approx(_true_error(layer, weight), rel=1e-6)


def test_hops_stop_after_the_probe_on_a_weight_the_format_only_approximates(monkeypatch):
    # a random kernel has no exact Odd fit: the first hops gain little, so hopping stops
    # there instead of running out its patience (32 idle hops for hops=64)
    runs = []
    real = als.run
    monkeypatch.setattr(als, "run", lambda *a, **k: runs.append(1) or real(*a, **k))
    weight = torch.randn(16, 16, 3, 3, generator=torch.Generator().manual_seed(0))
    formats.build("odd", 16, 16, 3, padding=1, rank=0.2).layer().fit_(weight, starts=1)
    assert len(runs) == 1 + als.PROBE + 1  # the start, the probe hops, the polish


def test_fit_of_a_linear_layer_matches_the_outputs_of_the_fitted_layer():
    fmt = formats.tt(64, 48, rank=4, in_modes=(4, 4, 4), out_modes=(4, 4, 3))
    weight = _instance(fmt, seed=1)
    layer = fmt.layer()
    error = layer.fit_(weight)
    eye = torch.eye(64)
    with torch.no_grad():
        from_outputs = (layer(eye) - layer.bias).T  # the weight as the layer applies it
    true = float(torch.linalg.norm(from_outputs - weight) / torch.linalg.norm(weight))
    assert error == pytest.approx(true, rel=1e-4) and error < 0.02


@pytest.mark.parametrize("kernel, kwargs", [
    ((3,), dict(stride=2, padding=1)),
    ((3, 5), dict(stride=(1, 2), padding=(1, 0), dilation=(2, 1), groups=2)),
    ((3, 1, 3), dict(padding=1)),
])
def test_fit_handles_groups_strides_and_dimensions(kernel, kwargs):
    fmt = formats.build("tucker2", 8, 12, kernel, rank=3, **kwargs)
    weight = _instance(fmt, seed=2)
    assert fmt.layer().fit_(weight) < 0.02


def test_fit_never_forms_a_large_gram_matrix_and_still_converges(monkeypatch):
    monkeypatch.setattr(als, "GRAM_ELEMENTS", 0)
    monkeypatch.setattr(als, "GRAM_FACTOR", 0)  # conjugate gradients for every core
    fmt = formats.tucker2(32, 32, 3, rank=6, padding=1)
    weight = _instance(fmt, seed=3)
    assert fmt.layer().fit_(weight) < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fit_keeps_the_dtype_and_leaves_the_global_rng_alone(dtype):
    fmt = formats.htk2(16, 16, 3, rank=3, padding=1)
    weight = _instance(fmt, seed=4, dtype=dtype)
    layer = fmt.layer(dtype=dtype)
    state = torch.get_rng_state()
    with torch.inference_mode():
        layer.fit_(weight, starts=2)
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.dtype == dtype for p in layer.parameters())


def test_fitted_cores_keep_graph_in_proportions():
    """The fit fixes the product of the cores; their scales follow Graph-in's split."""
    fmt = formats.cp(16, 16, 3, rank=6, padding=1)
    layer = fmt.layer()
    layer.fit_(_instance(fmt, seed=5))
    inits = {c.core: c.std(layer.sizes) for c in tnspec.analysis.init.core_inits(layer.network)}
    ratios = [float(getattr(layer, n).detach().std()) / s for n, s in inits.items()]
    assert max(ratios) / min(ratios) == pytest.approx(1.0, rel=1e-6)


def test_fit_of_a_zero_weight_gives_zero_cores_and_error_zero():
    layer = formats.cp(4, 4, 3, rank=2).layer()
    assert layer.fit_(torch.zeros(4, 4, 3, 3)) == 0.0
    assert not layer.dense_weight().any()


@pytest.mark.parametrize("weight, message", [
    (torch.zeros(4, 4, 3), r"the weight has shape \(4, 4, 3\), the layer's dense weight "
                           r"\(4, 4, 3, 3\)"),
    (torch.full((4, 4, 3, 3), float("nan")), "NaN or infinite"),
])
def test_fit_refuses_a_wrong_weight(weight, message):
    with pytest.raises(tnspec.SpecError, match=message):
        formats.cp(4, 4, 3, rank=2).layer().fit_(weight)


def test_fit_refuses_bad_settings_and_networks_without_a_dense_weight():
    layer = formats.cp(4, 4, 3, rank=2).layer()
    with pytest.raises(tnspec.SpecError, match="max_iter=0, starts=1, hops=64 and tol=0.1"):
        layer.fit_(torch.ones(4, 4, 3, 3), max_iter=0, starts=1, tol=0.1)
    with pytest.raises(TypeError, match="fit_ takes the dense weight as a torch.Tensor"):
        layer.fit_([[1.0]])
    odd = tnspec.layer("x[b, t, c], W[c, o] -> y[b, t, o]", c=2, o=3)
    with pytest.raises(tnspec.SpecError, match="is not a conv or linear layer"):
        odd.fit_(torch.ones(3, 2))


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 5 * 5, 10))


def test_tensorize_fit_copies_weights_and_bias_and_merge_round_trips():
    dense = _cnn()
    # make the dense weights exactly tucker2 of rank 4, so the fit can be exact
    exact = tnspec.merge(tnspec.tensorize(copy.deepcopy(dense), "tucker2", rank=4)[0])
    for m in exact.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.uniform_(m.bias)
    model, report = tnspec.tensorize(copy.deepcopy(exact), "tucker2", rank=4, weights="fit")
    x = torch.randn(2, 3, 5, 5)
    assert all(r.fit_error < 1e-6 for r in report.replaced)
    assert "fitted to its weights, relative error 0.0000" in str(report)
    torch.testing.assert_close(model(x), exact(x), rtol=1e-4, atol=1e-4)
    back = tnspec.merge(model)
    assert [type(m) for m in back] == [type(m) for m in exact]
    torch.testing.assert_close(back(x), exact(x), rtol=1e-4, atol=1e-4)


def test_merge_of_a_fit_is_within_the_reported_error():
    dense = _cnn()
    model, report = tnspec.tensorize(copy.deepcopy(dense), "cp", rank=0.3, weights="fit")
    merged = tnspec.merge(model)
    for r in report.replaced:
        before, after = dense.get_submodule(r.name), merged.get_submodule(r.name)
        w, fitted = before.weight.detach(), after.weight.detach()
        err = torch.linalg.norm(fitted - w) / torch.linalg.norm(w)
        assert float(err) == pytest.approx(r.fit_error, rel=1e-4)
        torch.testing.assert_close(after.bias, before.bias)


def test_tensorize_error_picks_the_smallest_share_that_reaches_it():
    torch.manual_seed(0)
    source = formats.tucker2(16, 16, 3, rank=4, padding=1).layer()
    conv = tnspec.merge(source)
    with torch.no_grad():
        conv.weight += 0.005 * conv.weight.std() * torch.randn_like(conv.weight)
    model, report = tnspec.tensorize(nn.Sequential(conv), "tucker2", weights="fit", error=0.02)
    (r,) = report.replaced
    assert r.fit_error <= 0.02
    assert model[0].sizes["r0"] >= 4 and r.params_after < r.params_before
    loose = tnspec.tensorize(nn.Sequential(copy.deepcopy(conv)), "tucker2", weights="fit",
                             error=0.9)[1].replaced[0]
    assert loose.params_after < r.params_after


def test_tensorize_refuses_unknown_weights_and_error_without_fit():
    with pytest.raises(tnspec.SpecError, match="weights='trained'"):
        tnspec.tensorize(_cnn(), weights="trained")
    with pytest.raises(tnspec.SpecError, match="error=0.1 needs weights='fit'"):
        tnspec.tensorize(_cnn(), error=0.1)


@pytest.mark.parametrize("fmt", ["cp", "tt", "tr", "odd", "depthwise_separable"])
@pytest.mark.parametrize("kernel, kwargs", [
    ((3,), dict(stride=2, padding=1)),
    ((3, 5), dict(stride=(1, 2), padding=(1, 0), dilation=(2, 1))),
    ((3, 1, 3), dict(padding=1)),
    ((), {}),
])
@pytest.mark.filterwarnings("ignore:.*of the dense layer it stands for")
def test_merge_gives_the_dense_module_computing_the_same(fmt, kernel, kwargs):
    if fmt == "depthwise_separable" and not kernel:
        return
    layer = formats.build(fmt, 8, 12, kernel, rank=2, **kwargs).layer(dtype=torch.float64)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(3, 8, *[9] * len(kernel), dtype=torch.float64)
    dense = tnspec.merge(copy.deepcopy(layer))
    assert type(dense) is (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)[len(kernel)]
    assert dense.weight.dtype == torch.float64
    torch.testing.assert_close(dense(x), layer(x))


def test_merge_keeps_layers_without_a_dense_weight_and_says_so():
    other = tnspec.layer("x[b, t, c], W[c, o] -> y[b, t, o]", c=2, o=3)
    model = nn.Sequential(formats.cp(2, 2, rank=1).layer(), other)
    with pytest.warns(UserWarning, match=r"merge kept 1 tnspec layer\(s\) that are neither "
                      "conv-like nor linear-like: 1"):
        merged = tnspec.merge(model)
    assert isinstance(merged[0], nn.Linear) and merged[1] is other


def test_the_tensorize_and_merge_docstring_examples_run():
    for module, examples in ((tensorize, 3), (merge, 3)):
        result = doctest.testmod(module, extraglobs={"nn": nn})
        assert result.failed == 0 and result.attempted >= examples


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fit_on_cuda():
    fmt = formats.tt(32, 32, 3, rank=4, padding=1)
    weight = _instance(fmt, seed=6).cuda()
    layer = fmt.layer(device="cuda")
    assert layer.fit_(weight) < 0.02
    assert layer.A.device.type == "cuda"


def _problems(net) -> dict:
    lay = decompose.layout(net)
    labels = {k.name: k.indices for k in net.cores}
    return {name: als.Problem(name, labels, lay, net.sizes) for name in labels}


def test_every_other_start_gives_a_many_bond_factor_its_subspace():
    """A block-term factor A[c, r0, n] spans at most r0 * n of the c dimensions: odd starts
    give it the leading singular subspace of the weight unfolded along c (in a random basis),
    even starts a Graph-in draw; a single-bond factor gets its singular vectors every time."""
    fmt = formats.build("block_term", 32, 32, 3, padding=1, rank=0.2)
    net = fmt.layer().network
    lay = decompose.layout(net)
    w = _instance(fmt, seed=0).double().reshape(lay.modes)
    stds = {c.name: 1.0 for c in net.cores}
    unfolded = w.movedim(lay.target.index("c"), 0).reshape(32, -1)
    top = torch.linalg.svd(unfolded, full_matrices=False)[0][:, :8]  # r0 * n = 4 * 2

    def outside(core: torch.Tensor) -> float:  # of A's columns, the share outside that span
        cols = core.reshape(32, -1)
        return float(torch.linalg.norm(cols - top @ (top.T @ cols)) / torch.linalg.norm(cols))
    for seed in range(4):
        cores, seeded = als.start(net, w, _problems(net), stds, seed)
        assert ("A" in seeded) is (seed % 2 == 1)
        assert (outside(cores["A"]) < 1e-9) is (seed % 2 == 1)
    fmt = formats.build("tucker2", 32, 32, 3, padding=1, rank=0.2)
    net = without_units(fmt.layer().network)  # as fit sees it: U[r0, c], not U[r0, c, 1, 1]
    w = _instance(fmt, seed=0).double().reshape(decompose.layout(net).modes)
    stds = {c.name: 1.0 for c in net.cores}
    for seed in range(2):
        assert als.start(net, w, _problems(net), stds, seed)[1] == {"U", "V"}


def test_an_unreachable_error_goal_keeps_the_layer_dense_and_says_so():
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 16, 3, padding=1)  # a random kernel: no low-rank structure
    model, report = tnspec.tensorize(nn.Sequential(conv), "tucker2", weights="fit", error=0.01)
    assert model[0] is conv and not report.replaced
    assert report.params_after == report.params_before
    ((name, why),) = report.skipped
    assert name == "0" and "kept dense: the goal error=0.01 is not reached" in why
    assert "kept dense" in str(report)


def test_fit_options_pass_through_tensorize(monkeypatch):
    seen = []
    real = decompose.fit

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(decompose, "fit", spy)
    options = {"hops": 0, "starts": 1, "max_seconds": 30, "max_iter": 50, "tol": 1e-6}
    _, report = tnspec.tensorize(_cnn(), "tr", rank=0.5, weights="fit", fit=options,
                                 exclude="0")
    assert len(report.replaced) == 2 and len(seen) == 2
    assert all(kw == options for kw in seen)


def test_tensorize_refuses_unknown_keywords_naming_itself():
    with pytest.raises(TypeError, match=r"tensorize\(\) got an unexpected keyword argument "
                                        r"'hops'; fit options go in fit="):
        tnspec.tensorize(_cnn(), "tr", weights="fit", hops=0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'rnak'; a format's "
                                        r"options are in_modes"):
        tnspec.tensorize(_cnn(), "tr", rnak=4)
    with pytest.raises(TypeError, match=r"tensorize\(fit=...\) got an unexpected fit option "
                                        r"'hop'; the options are max_iter"):
        tnspec.tensorize(_cnn(), "tr", weights="fit", fit={"hop": 0})
    with pytest.raises(tnspec.SpecError, match="fit= needs weights='fit'"):
        tnspec.tensorize(_cnn(), "tr", fit={"hops": 0})
    with pytest.raises(tnspec.SpecError, match="max_seconds=0 must be a positive number"):
        tnspec.tensorize(_cnn(), "tr", weights="fit", fit={"max_seconds": 0})


def test_fit_stops_at_max_seconds_keeps_the_best_so_far_and_logs_it(caplog, ticking):
    fmt = formats.build("odd", 16, 16, 3, padding=1, rank=0.3)
    weight = _instance(fmt, seed=1)
    layer = fmt.layer()
    reads = ticking(1.0)  # every look at the clock takes a second
    with caplog.at_level("INFO", logger="tnspec"):
        error = layer.fit_(weight, max_seconds=5)
    assert error == pytest.approx(_true_error(layer, weight), rel=1e-6) and error < 1
    assert any("stopped by max_seconds=5" in r.getMessage() for r in caplog.records)
    assert len(reads) < 40  # it stopped, rather than running out its sweeps and hops


def test_fit_of_a_single_core_network_is_exact():
    layer = tnspec.layer("x[b, i], W[i, o] -> y[b, o]", i=4, o=3)
    weight = torch.randn(3, 4)
    assert layer.fit_(weight) < 1e-12
    torch.testing.assert_close(layer.dense_weight().detach(), weight)
    model, report = tnspec.tensorize(nn.Sequential(nn.Linear(4, 3)), "standard",
                                     weights="fit")
    assert report.replaced[0].fit_error < 1e-6 and not report.skipped


@pytest.mark.parametrize("name", ["tucker2", "tt", "cp", "standard"])
def test_fit_to_an_all_zero_weight_leaves_a_layer_that_trains(name):
    """A zero-initialized conv (ControlNet, zero-init residual branches): all cores zero would
    be a saddle where every gradient is zero; one core zero keeps the layer zero and
    trainable."""
    conv = nn.Conv2d(8, 8, 3, padding=1)
    nn.init.zeros_(conv.weight)
    nn.init.zeros_(conv.bias)
    model, report = tnspec.tensorize(nn.Sequential(conv), name, rank=0.5, weights="fit")
    layer = model[0]
    assert report.replaced[0].fit_error == 0.0
    assert not layer.dense_weight().detach().any()
    assert "all zero" in report.replaced[0].note and "all zero" in str(report)
    x = torch.randn(2, 8, 6, 6)
    assert not layer(x).detach().any()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):  # the zeroed core moves first, then the others
        opt.zero_grad()
        (layer(x) - torch.randn(2, 8, 6, 6)).square().mean().backward()
        opt.step()
    assert layer.dense_weight().detach().abs().sum() > 0


class _GainConv2d(nn.Conv2d):
    """A learned gain per output channel in forward: not a conv of its raw weight, and no
    reading tnspec knows (a "same" pad, a standardized weight) computes it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.full((self.out_channels, 1, 1, 1), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight * self.gain, self.bias)


class _LoraLinear(nn.Linear):
    def __init__(self, i: int, o: int) -> None:
        super().__init__(i, o)
        self.a, self.b = nn.Parameter(torch.randn(i, 2)), nn.Parameter(torch.randn(2, o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x @ self.a @ self.b


class _PlainSubclass(nn.Conv2d):
    """A subclass that changes nothing a forward computes: replaced as a Conv2d."""


@pytest.mark.parametrize("weights", ["init", "fit"])
def test_subclasses_that_override_forward_are_skipped_and_reported(weights):
    model = nn.Sequential(_GainConv2d(8, 8, 3, padding=1), nn.ReLU(),
                          _PlainSubclass(8, 8, 3, padding=1), nn.Flatten(),
                          _LoraLinear(8 * 4 * 4, 10))
    std, lora = model[0], model[4]
    model, report = tnspec.tensorize(model, "tucker2", rank=0.5, weights=weights)
    assert model[0] is std and model[4] is lora
    assert isinstance(model[2], tnspec.Layer)
    why = dict(report.skipped)
    assert why["0"] == "_GainConv2d overrides forward: a layer of its weight would not compute " \
                       "what it does (no 'same' pad or weight standardization found that " \
                       "computes it)"
    assert "_LoraLinear overrides forward" in why["4"]


def test_merge_replaces_a_shared_layer_at_every_name_with_one_module():
    layer = formats.cp(8, 8, 3, rank=4, padding=1).layer()
    model = nn.Sequential(layer, nn.ReLU(), layer)
    x = torch.randn(2, 8, 6, 6)
    want = model(x)
    merged = tnspec.merge(model)
    assert isinstance(merged[0], nn.Conv2d) and merged[0] is merged[2]
    torch.testing.assert_close(merged(x), want, rtol=1e-4, atol=1e-5)


def test_frozen_parameters_and_eval_mode_survive_tensorize_and_merge():
    model = _cnn()
    model[2].weight.requires_grad_(False)  # a frozen conv with a trainable bias
    model[2].eval()
    model[4].requires_grad_(False)  # a frozen classifier, in train mode
    model, _ = tnspec.tensorize(model, "tucker2", rank=0.5, weights="fit", exclude="0")
    conv, head = model[2], model[4]
    assert not conv.training and head.training
    assert all(not p.requires_grad for n, p in conv.named_parameters() if n != "bias")
    assert conv.bias.requires_grad
    assert not any(p.requires_grad for p in head.parameters())
    model = tnspec.merge(model)
    assert isinstance(model[2], nn.Conv2d) and not model[2].training and model[4].training
    assert not model[2].weight.requires_grad and model[2].bias.requires_grad
    assert not any(p.requires_grad for p in model[4].parameters())


def test_transformer_feed_forward_layers_are_skipped_and_eval_still_runs():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
                                  num_layers=1, enable_nested_tensor=False)
    model, report = tnspec.tensorize(model, "tt", rank=0.5)
    why = dict(report.skipped)
    assert "TransformerEncoderLayer reads this layer's weight directly" in \
        why["layers.0.linear1"]
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(2, 5, 32)).shape == (2, 5, 32)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tensorize_shows_a_line_per_layer_on_a_terminal_and_nothing_otherwise(monkeypatch,
                                                                             capsys):
    tnspec.tensorize(_cnn(), "tucker2", rank=0.5, weights="fit")
    assert capsys.readouterr().err == ""  # not a terminal: silent
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    tnspec.tensorize(_cnn(), "tucker2", rank=0.5, weights="fit", exclude="5")
    # what the terminal shows of each line: the text after its last carriage return; a fit
    # that runs past a few seconds (on a busy machine) shows its own status lines too
    lines = [line.split("\r")[-1].replace("\x1b[K", "") for line in
             screen.getvalue().split("\n") if line]
    lines = [line for line in lines if not line.startswith("fit layer")]
    assert lines[0].startswith("tensorize: 0: Conv2d -> tucker2, fit error ")
    assert lines[1].startswith("tensorize: 2: Conv2d -> tucker2, fit error ")
    assert len(lines) == 2


def test_a_grouped_convs_fit_runs_on_two_threads():
    """The least-squares step of a grouped conv's fit solves a batch of Gram matrices. With
    torch 2.13's batched LU on two CPU threads it failed inside MKL ("Pivots given to lu_solve
    must all be greater or equal to 1") wherever the matrices needed pivoting; they are
    positive definite (a Gram with a ridge) and are solved by Cholesky now."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        conv = nn.Sequential(nn.Conv2d(64, 128, 3, groups=4, padding=1))
        _, report = tnspec.tensorize(conv, "tucker2", rank=0.5, weights="fit")
    finally:
        torch.set_num_threads(threads)
    assert [r.name for r in report.replaced] == ["0"] and report.replaced[0].fit_error < 0.7


def test_the_spd_solve_equals_lu_and_solves_a_matrix_cholesky_refuses_alone():
    from tnspec.fit.als import _spd_solve
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 40, 40, generator=gen, dtype=torch.float64)
    g = a @ a.mT + torch.eye(40, dtype=torch.float64)
    g[1] = a[1] + a[1].mT  # symmetric, indefinite: Cholesky fails on this one alone
    rows = torch.randn(3, 40, 5, generator=gen, dtype=torch.float64)
    want = torch.stack([torch.linalg.solve(g[i], rows[i]) for i in range(3)])
    torch.testing.assert_close(_spd_solve(g, rows), want)
