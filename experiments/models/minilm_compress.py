"""all-MiniLM-L6-v2's encoder compressed to 75%, 50% and 25% of its linear layers' parameters:
``tnspec.compress`` with data (as it is, ``sequential=True``, and sequential with a healing
pass of 200 steps) against per-layer truncated SVD (weight-only), activation-aware SVD
(SVD-LLM / ASVD: the SVD of ``W`` whitened by the inputs' second moment) and TensorLy-Torch's
factorized (Tucker) linear layers fitted from the weights, at equal parameters.

Measured on Rotten Tomatoes snippets (fresh vs rotten): the accuracy of a logistic-regression
probe on mean-pooled sentence embeddings (fixed split, the probe refitted per model) and the
cosine of each test embedding to the original model's.

    python -m experiments.models.minilm_compress            # ~60 min on 2 cores
    python -m experiments.models.minilm_compress --smoke    # a tiny version (the tests run it)
    python -m experiments.models.minilm_compress --allocation 0.75 0.5 0.25  # ~24 min
    python -m experiments.models.minilm_compress --budgets 0.5   # ~20 min, its own file
    python -m experiments.models.minilm_compress --budgets 0.25  # ~18 min, its own file
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import tnspec

from .. import assets
from ..common import formats_chosen, markdown_table, save, svd_factors

ENCODER = "encoder."  # the layers compressed: the encoder's (smoke: its last block's)
BUDGETS = (0.75, 0.5, 0.25)


def embeddings(model: nn.Module, tokenizer, texts: list[str], batch: int = 64) -> torch.Tensor:
    """Mean-pooled last hidden states, as sentence-transformers pools MiniLM's."""
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i:i + batch], padding=True, truncation=True, max_length=64,
                            return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden)
            out.append((hidden * mask).sum(1) / mask.sum(1))
    return torch.cat(out)


def probe(train: torch.Tensor, y_train: torch.Tensor, test: torch.Tensor,
          y_test: torch.Tensor) -> float:
    """Test accuracy of a logistic regression fitted on the training embeddings."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler
    scale = StandardScaler().fit(train.numpy())
    clf = LogisticRegression(max_iter=2000).fit(scale.transform(train.numpy()), y_train.numpy())
    return float(clf.score(scale.transform(test.numpy()), y_test.numpy()))


def linears(model: nn.Module, prefix: str) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules()
            if n.startswith(prefix) and isinstance(m, nn.Linear)]


def factored(weight: torch.Tensor, bias: torch.Tensor | None, rank: int
             ) -> tuple[nn.Linear, nn.Linear]:
    """Two linear layers for ``W ~ B A`` at rank ``rank``, the bias on the second."""
    first = nn.Linear(weight.shape[1], rank, bias=False)
    second = nn.Linear(rank, weight.shape[0], bias=bias is not None)
    return first, second


def low_rank(model: nn.Module, budget: float, moments: dict[str, torch.Tensor] | None,
             prefix: str) -> nn.Module:
    """Every encoder linear layer as a rank-r product holding ``budget`` of its parameters
    (bias included): the truncated SVD of ``W`` (``moments`` None), or of ``W S`` with ``S`` the
    square root of the inputs' second moment, damped by 1% of its mean eigenvalue, mapped back
    by ``S^-1`` (activation-aware SVD). Written here from scratch, apart from tnspec."""
    model = copy.deepcopy(model)
    for name, lin in linears(model, prefix):
        out, inp = lin.weight.shape
        rank = max(1, int((budget * (out * inp + out) - out) // (out + inp)))
        w = lin.weight.detach().double()
        a, b = svd_factors(w, None if moments is None else moments[name], rank)
        first, second = factored(w, lin.bias, rank)
        with torch.no_grad():
            first.weight.copy_(a.float())
            second.weight.copy_(b.float())
            if lin.bias is not None:
                second.bias.copy_(lin.bias)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, nn.Sequential(first, second))
    return model


def second_moments(model: nn.Module, batches: list[dict], prefix: str
                   ) -> dict[str, torch.Tensor]:
    """Per encoder linear layer, the mean of ``x x^T`` over the rows that reach it."""
    sums, counts, handles = {}, {}, []
    for name, lin in linears(model, prefix):
        def hook(_, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]
        handles.append(lin.register_forward_pre_hook(hook))
    with torch.no_grad():
        for b in batches:
            model(**b)
    for h in handles:
        h.remove()
    return {n: sums[n] / counts[n] for n in sums}


def tensorly_tucker(model: nn.Module, budget: float, prefix: str) -> nn.Module:
    """Every encoder linear layer as TensorLy-Torch's ``FactorizedLinear`` (Tucker, modes
    chosen by TensorLy-Torch), fitted to its weight, at ``budget`` of its parameters: its
    ``rank`` share (of the tensorized weight's parameters, which is not the layer's) found by
    bisection so that the parameters, bias included, come nearest the budget (TensorLy-Torch's
    Tucker ranks move the count in steps of up to a third)."""
    import tltorch
    model = copy.deepcopy(model)
    for name, lin in linears(model, prefix):
        shape = tltorch.FactorizedLinear.from_linear(lin, rank=budget, factorization="tucker",
                                                     implementation="factorized")
        target = budget * sum(p.numel() for p in lin.parameters())

        def size(rank: float) -> int:
            return sum(p.numel() for p in tltorch.FactorizedLinear(
                shape.in_tensorized_features, shape.out_tensorized_features, rank=rank,
                factorization="tucker").parameters())
        low, high = 0.0, 1.0
        for _ in range(12):
            rank = (low + high) / 2
            low, high = (rank, high) if size(rank) <= target else (low, rank)
        best = min((low, high), key=lambda r: abs(size(r) - target))  # nearest, either side
        new = tltorch.FactorizedLinear.from_linear(lin, rank=best, factorization="tucker",
                                                   implementation="factorized")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model


def encoder_params(model: nn.Module, prefix: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if n.startswith(prefix) and "LayerNorm" not in n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (seconds)")
    parser.add_argument("--allocation", type=float, nargs="+", metavar="BUDGET",
                        help="only these budgets: the two SVDs and compress by default "
                             "(each layer at the budget) and with shares=SHARES (a rank per "
                             "layer), written to results/minilm_compress_allocation.md (~8 min "
                             "a budget)")
    parser.add_argument("--budgets", type=float, nargs="+", metavar="BUDGET",
                        help="the full comparison at these budgets only, written to "
                             "results/minilm_compress_<budgets>.md (~20 min a budget)")
    args = parser.parse_args(argv)
    prefix = "encoder.layer.5." if args.smoke else ENCODER
    started = time.time()
    torch.manual_seed(0)
    model, tokenizer = assets.minilm()
    texts, labels = assets.rotten_tomatoes()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))
    n_train, n_test, n_fit = (64, 64, 32) if args.smoke else (3000, 3000, 256)
    train_idx, test_idx = order[:n_train], order[n_train:n_train + n_test]
    fit_texts = [texts[i] for i in order[-n_fit:]]  # the data compress sees: held out
    batches = [dict(tokenizer(fit_texts[i:i + 32], padding=True, truncation=True,
                              max_length=64, return_tensors="pt"))
               for i in range(0, n_fit, 32)]
    train_texts, test_texts = [texts[i] for i in train_idx], [texts[i] for i in test_idx]
    y_train, y_test = labels[train_idx], labels[test_idx]
    budgets = (0.5,) if args.smoke else tuple(args.allocation or args.budgets or BUDGETS)
    dense = encoder_params(model, prefix)

    def measure(m: nn.Module) -> tuple[float, float, int]:
        tr = embeddings(m, tokenizer, train_texts)
        te = embeddings(m, tokenizer, test_texts)
        cos = float(nn.functional.cosine_similarity(te, reference).mean())
        return probe(tr, y_train, te, y_test), cos, encoder_params(m, prefix)

    reference = embeddings(model, tokenizer, test_texts)
    base_acc, _, _ = measure(model)
    rows = [("original", "-", f"{dense:,}", base_acc, 1.0, "-")]
    moments = second_moments(model, batches, prefix)
    fits = []
    small = {"formats": ("low_rank", "tt"), "shares": (0.25, 0.5)} if args.smoke else {}
    for budget in budgets:
        methods = {
            "truncated SVD (weight-only)": lambda: low_rank(model, budget, None, prefix),
            "activation-aware SVD": lambda: low_rank(model, budget, moments, prefix),
            "TensorLy-Torch Tucker (weights)": lambda: tensorly_tucker(model, budget, prefix),
            "tnspec.compress with data": lambda: tnspec.compress(
                copy.deepcopy(model), budget, data=batches, include=prefix + "*", **small),
            "tnspec.compress, sequential": lambda: tnspec.compress(
                copy.deepcopy(model), budget, data=batches, include=prefix + "*",
                sequential=True, **small),
            "tnspec.compress, sequential, healed (200 steps)": lambda: tnspec.compress(
                copy.deepcopy(model), budget, data=batches, include=prefix + "*",
                sequential=True, heal=2 if args.smoke else 200, **small)}
        if args.allocation:  # how deep compress may cut a layer, against the two SVDs
            methods = {name: methods[name] for name in (
                "truncated SVD (weight-only)", "activation-aware SVD",
                "tnspec.compress with data")}
            methods["tnspec.compress with data, shares=SHARES (a rank per layer)"] = \
                lambda: tnspec.compress(copy.deepcopy(model), budget, data=batches,
                                        include=prefix + "*",
                                        **{"shares": tnspec.workflows.convert.compress.SHARES,
                                           **small})
        for method, make in methods.items():
            t = time.time()
            made = make()
            seconds = time.time() - t
            if isinstance(made, tuple):
                made, report = made
                fits.append(f"budget {budget:.0%}, {method}: {report.seconds:.0f} s; formats "
                            "chosen: "
                            + formats_chosen(report)
                            + "".join(f"; {line.strip()}" for line in str(report).splitlines()
                                      if line.strip().startswith(("sequential:", "healed:"))))
            acc, cos, params = measure(made)
            rows.append((method, f"{budget:.0%}", f"{params:,} ({params / dense:.0%})", acc,
                         cos, f"{seconds:.0f}"))
            print(rows[-1], flush=True)
    text = ("# all-MiniLM-L6-v2 compressed: Rotten Tomatoes probe and cosine\n\n"
            f"{n_train:,} training / {n_test:,} test snippets (fixed split), {n_fit} held-out "
            "snippets for the data-aware methods (8 batches of 32, at most 64 tokens). "
            "Parameters: the encoder's linear layers (weights and biases).\n\n"
            + markdown_table(["method", "budget", "parameters", "probe accuracy",
                              "cosine to original", "seconds to compress"], rows)
            + "\n\n" + "\n".join(f"- compress at {line}" for line in fits))
    print(text)
    if not args.smoke:  # a smoke run writes nothing
        name = "minilm_compress_allocation" if args.allocation else "minilm_compress" + (
            "_" + "_".join(f"{b:g}" for b in budgets) if args.budgets else "")
        print(f"wrote {save(name, text, started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
