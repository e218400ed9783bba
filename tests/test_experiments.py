"""Smoke versions of the experiments (experiments/paper/: the paper's; experiments/models/:
tnspec's workflows on trained models): tiny sizes, and the qualitative claim that holds robustly
at that size. The full runs are `python -m experiments.paper.NAME` and
`python -m experiments.models.NAME`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("sklearn", reason="the experiments use scikit-learn's digits")
pytest.importorskip("tqdm", reason="the experiments show tqdm progress bars")

from experiments.paper import allconv, audit, prop2, propagation, random_formats  # noqa: E402
from experiments.models import adapter_dynamics, adapters, decompose  # noqa: E402
from experiments.common import digits, fashion, train_steps  # noqa: E402


def _fashion(train: int, test: int) -> tuple[torch.Tensor, ...]:
    """A slice of Fashion-MNIST, or a skip where the Debian package is not installed."""
    from experiments import assets
    try:
        return fashion(train, test)
    except assets.Missing as exc:
        pytest.skip(str(exc))


def test_prop2_gaussian_scales_are_the_contracted_sizes():
    results = prop2.run(rounds=20)
    means = results["Gaussian"].mean(0)
    truth = np.array(prop2.WIDTHS[:-1], dtype=float)
    assert (abs(means / truth - 1) < 0.05).all(), means
    assert abs(results["digits"].mean(0)[0] / 96 - 1) < 0.1  # standardized real data too
    assert results["digits, raw"].mean(0)[0] > 1.3 * 96  # raw pixels: the mean adds E[x]^2


@pytest.mark.parametrize("phi", [1, 4])
def test_graph_in_keeps_odd5_tanh_alive_and_unsaturated_where_xavier_per_core_does_not(phi):
    x = digits()[2]
    models = propagation.models(phi, seed=0)
    for name in ("graph-in (Odd-5)", "graph-out (Odd-5)", "Xavier (Linear-5)"):
        acts = propagation.activations(models[name], x)
        assert max(propagation.saturation(acts)) < 0.05, name
        assert all(0.1 < a.std() < 0.9 for a in acts), name
    for name in ("xavier (Odd-5)", "orthogonal (Odd-5)"):
        acts = propagation.activations(models[name], x)
        assert acts[-1].std() < 1e-3, name  # the signal is gone by the last layer


def test_random_formats_graph_in_keeps_the_scale_per_core_inits_lose_it():
    x = digits(images=True)[2][:64]
    for seed in range(3):
        graph = random_formats.init_std(seed, "graph-in", x)
        assert 0.02 < graph < 2
        for init in ("xavier", "orthogonal"):
            assert random_formats.init_std(seed, init, x) < 1e-3 * graph


def test_allconv_graph_in_keeps_the_scale_per_core_kaiming_does_not():
    x = digits(images=True)[2][:64]
    for fmt in ("tr", "odd"):
        assert 0.2 < allconv.init_scale(fmt, "graph-in", x) < 5, fmt
    for init in ("kaiming-in", "kaiming-out"):  # vanishes or explodes, by more than 10x
        scale = allconv.init_scale("odd", init, x)
        assert not 0.1 < scale < 10, init


def test_every_experiment_command_runs_its_smoke_version(capsys):
    for module in (prop2, propagation, random_formats, allconv, audit, decompose, adapters,
                   adapter_dynamics):
        assert module.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count("| Ground truth |") == 1 and "graph-in (Odd-5)" in out
    assert "| tt | 0.01 |" in out  # adapter_dynamics' row


def test_the_rates_experiment_runs_its_smoke_version_with_and_without_the_rule(capsys):
    from experiments.models import adapter_rates
    assert adapter_rates.main(["--smoke", "--workers", "1", "--methods", "tt",
                               "tt +rule", "tt +rule, raw at init"]) == 0
    out = capsys.readouterr().out
    assert "| tt +rule | 13,850 (1.78%) |" in out and "| 0.01 |" in out


def test_training_is_reproducible_from_the_seeds():
    """Same seeds, same numbers: the committed tables can be reproduced."""
    from experiments.common import train
    data = [t[:200] for t in digits(images=True)]

    def run():
        torch.manual_seed(3)
        net = random_formats.Conv4(3, "graph-in")
        return train(net, data, lambda p: torch.optim.Adam(p, lr=1e-3), epochs=2, batch=64,
                     seed=3)
    assert run() == run()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["minilm_compress", "minilm_embedding", "mobilenet_fashion",
                                  "minilm_adapters", "minilm_inference",
                                  "mobilenet_inference", "minilm_collapse",
                                  "mobilenet_adapters", "mobilenet_compress",
                                  "mobilenet_compress --heal", "compress_pruning"])
def test_the_real_model_experiments_run_their_smoke_versions(name, capsys):
    """On the real checkpoints and data, a slice (about a minute each: ``--runslow``); skipped
    where an asset is not installed. tests/workflows/test_real_models.py runs the workflows
    themselves on those assets in the default suite."""
    import importlib

    from experiments import assets
    name, *options = name.split()
    module = importlib.import_module(f"experiments.models.{name}")
    try:
        assert module.main(["--smoke", *options]) == 0
    except assets.Missing as exc:
        pytest.skip(str(exc))
    out = capsys.readouterr().out
    expected = {"minilm_adapters": "| tnspec tt |", "minilm_collapse": "| step | loss |",
                "mobilenet_adapters": "| low_rank default |", "compress_pruning": "| prune |"}
    assert expected.get(name, "| original |") in out


def test_the_trial_step_rule_changes_the_parametrization_not_the_function():
    """adapter_dynamics --equal-rate: the same adapter outputs, learning cores of std n / R."""
    import tnspec
    torch.manual_seed(0)
    model, _ = tnspec.adapt(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1)), "tr", rank=0.5,
                            init="zero")  # the trial was made for the zero-core start
    layer = model[0]
    with torch.no_grad():
        getattr(layer.adapters["default"], layer.zeroed["default"]).normal_()
    x = torch.randn(2, 8, 5, 5)
    want = model(x)
    adapter_dynamics.equal_rate(model, 13.0)
    torch.testing.assert_close(model(x), want, rtol=1e-4, atol=1e-5)
    learning = [p for n, p in layer.adapters["default"].named_parameters()
                if n != layer.zeroed["default"]]
    for p in learning:
        assert float(p.std()) == pytest.approx(len(learning) / 13.0, rel=1e-4)


def test_the_fashion_loader_gives_standardized_images_and_every_class():
    x_tr, y_tr, x_te, y_te = _fashion(2000, 1000)
    assert x_tr.shape == (2000, 1, 28, 28) and x_te.shape == (1000, 1, 28, 28)
    assert x_tr.dtype == torch.float32 and y_tr.dtype == torch.int64
    assert abs(float(x_tr.mean())) < 1e-4 and abs(float(x_tr.std()) - 1) < 1e-4
    assert set(y_tr.tolist()) == set(range(10)) and set(y_te.tolist()) == set(range(10))
    from experiments import assets
    _, labels = assets.fashion_mnist("test")
    assert labels.bincount().tolist() == [1000] * 10  # the whole test split, balanced


def test_the_fashion_loader_names_the_debian_package_when_the_files_are_absent(
        tmp_path, monkeypatch):
    from experiments import assets
    monkeypatch.setattr(assets, "FASHION", tmp_path)
    with pytest.raises(assets.Missing, match="apt-get install dataset-fashion-mnist"):
        fashion(10, 10)


def test_the_fashion_loader_refuses_a_file_that_is_not_an_idx_file(tmp_path, monkeypatch):
    import gzip

    from experiments import assets
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        with gzip.open(tmp_path / name, "wb") as f:
            f.write(b"<html>not found</html>" * 10)
    monkeypatch.setattr(assets, "FASHION", tmp_path)
    with pytest.raises(ValueError, match="not an idx file.*reinstall dataset-fashion-mnist"):
        assets.fashion_mnist("test")


def test_training_by_steps_records_evenly_and_ends_on_the_whole_test_set():
    data = _fashion(300, 250)

    def run():
        torch.manual_seed(0)
        model = random_formats.Conv4(0, "graph-in", random_formats.STRIDES["fashion"])
        return model, train_steps(model, data, lambda p: torch.optim.Adam(p, lr=1e-3),
                                  steps=12, batch=64, seed=0, evals=3, probe=100)
    net, hist = run()
    assert len(hist.train_loss) == len(hist.test_acc) == 3
    with torch.no_grad():
        acc = float((net(data[2]).argmax(1) == data[3]).float().mean())
    assert hist.final_acc == pytest.approx(acc)  # the last record: all 250 test images
    assert run()[1] == hist  # same seeds, same numbers


def test_on_fashion_graph_in_keeps_the_scale_where_per_core_inits_lose_it():
    x = _fashion(10, 64)[2]
    strides = random_formats.STRIDES["fashion"]
    for seed in range(3):
        graph = random_formats.init_std(seed, "graph-in", x, strides)
        assert 0.02 < graph < 2
        for init in ("xavier", "orthogonal"):
            assert random_formats.init_std(seed, init, x, strides) < 1e-3 * graph
    for fmt in ("tr", "odd"):
        assert 0.2 < allconv.init_scale(fmt, "graph-in", x) < 5, fmt
        for init in ("kaiming-in", "kaiming-out"):
            assert not 0.1 < allconv.init_scale(fmt, init, x) < 10, (fmt, init)


def test_the_fashion_experiments_run_their_smoke_versions(capsys):
    _fashion(1, 1)
    for module in (random_formats, allconv):
        assert module.main(["--data", "fashion", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "nets > 50% (of 1)" in out and "| odd | 43,402 |" in out


@pytest.mark.parametrize("spectral", [False, True])
def test_the_fixed_norm_trial_rules_keep_the_function_and_each_learning_cores_norm(spectral):
    """adapter_dynamics --fixed-norms / --fixed-spectral: the same adapter at init; after
    Adam steps the zero core has moved and every other core keeps its init (spectral) norm."""
    import tnspec
    torch.manual_seed(0)
    model, _ = tnspec.adapt(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1)), "tr", rank=0.5)
    layer = model[0]
    x = torch.randn(2, 8, 5, 5)
    net, zero = layer.adapters["default"], layer.zeroed["default"]

    def size(core: torch.Tensor) -> float:
        return float(adapter_dynamics._FixedSpectral.spectral(core) if spectral
                     else core.norm())
    cores = [n for n, _ in net.named_parameters() if n != zero]
    before = {n: size(getattr(net, n)) for n in cores}
    want = model(x)
    adapter_dynamics.fixed_norms(model, spectral=spectral)
    torch.testing.assert_close(model(x), want)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().neg().backward()
        opt.step()
    assert float(getattr(net, zero).norm()) > 0
    for n in cores:
        assert size(getattr(net, n).detach()) == pytest.approx(before[n], rel=1e-4), n


def test_the_inner_cores_trial_fixes_the_cores_with_two_bonds_and_leaves_the_ends_free():
    import tnspec
    torch.manual_seed(0)
    model, _ = tnspec.adapt(nn.Sequential(nn.Conv2d(16, 16, 3, padding=1)), "tt_lora",
                            rank=0.5)
    net = model[0].adapters["default"]  # A[c0, r0], B[r0, c1, r1], C[.., kh, kw, ..], D, E
    assert {t.name: adapter_dynamics._bonds(net, t.name) for t in net.network.cores} == \
        {"A": 1, "B": 2, "C": 2, "D": 2, "E": 1}
    adapter_dynamics.fixed_norms(model, spectral="interior")
    fixed = {n.split(".")[1] for n, _ in net.named_parameters() if n.startswith("parametriz")}
    assert fixed == {"B", "C", "D"}  # E is the zero core, A an end


def test_the_drift_probe_shows_the_ring_running_away_unless_its_spectral_norms_are_fixed():
    """adapter_dynamics --drift, the figures behind docs/adapters.md's table, on two formats."""
    built = adapter_dynamics.drift("tr", 0.05, None, steps=30)
    spectral = adapter_dynamics.drift("tr", 0.05, True, steps=30)
    lora = adapter_dynamics.drift("low_rank", 0.05, None, steps=30)
    assert built > 20 * lora and spectral < 5 * lora, (built, spectral, lora)


def test_the_curve_table_finds_the_step_the_principal_start_reaches_the_zero_starts_final():
    """minilm_adapters --curve: means over seeds, compared with the zero start's final mean;
    a start that never reaches it says so."""
    from experiments.models.minilm_adapters import curve_tables
    curves = {("tt zero", 1e-3): [[(25, 0.60), (50, 0.70), (75, 0.80)],
                                  [(25, 0.62), (50, 0.72), (75, 0.78)]],   # final mean 0.79
              ("tt principal", 1e-3): [[(25, 0.70), (50, 0.80), (75, 0.82)],
                                       [(25, 0.74), (50, 0.77), (75, 0.84)]],  # 0.785 at 50
              ("tr zero", 1e-3): [[(25, 0.6), (50, 0.7), (75, 0.8)]] * 2,
              ("tr principal", 1e-3): [[(25, 0.6), (50, 0.7), (75, 0.79)]] * 2}
    text = curve_tables(curves, (1e-3,))
    assert "| tt principal | 0.720 | 0.785 | 0.830 |" in text
    assert "| tt | 0.790 | 0.830 | 75 | 1.00 |" in text
    assert "| tr | 0.800 | 0.790 | not reached |  |" in text
