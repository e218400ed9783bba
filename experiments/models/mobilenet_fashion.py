"""torchvision's ImageNet MobileNetV2 transferred to Fashion-MNIST (images resized to 96x96 and
repeated to 3 channels).

1. Frozen features and a logistic-regression probe on the pooled 1,280 features: the original
   network, its 1x1 convs compressed to 50% of their parameters by ``tnspec.compress`` with data
   (sensitivities measured on the ImageNet logits, or on the pooled features through ``run=``;
   then also ``sequential=True`` with a healing pass of 200 steps, and with no layer cut below
   a third or every layer at a half), and by the truncated SVD of each (weight-only, the same
   parameters).
2. Fine-tuning with adapters on the 1x1 convs at about 1% of the network's parameters, the new
   head trained in full (``modules_to_save``): tnspec's formats against PEFT's LoRA at the same
   trainable parameters, one seed, the same batches.

    python -m experiments.models.mobilenet_fashion          # ~7 min alone on 2 cores
    python -m experiments.models.mobilenet_fashion --smoke
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

import tnspec

from .. import assets
from . import mobilenet
from ..common import formats_chosen, markdown_table, save

SIZE = 96


def pointwise(name: str, module: nn.Module) -> bool:
    """The 1x1 convs of the feature extractor (expansions and projections)."""
    return name.startswith("features.") and isinstance(module, nn.Conv2d) and \
        module.kernel_size == (1, 1)


def features(model: mobilenet.MobileNetV2, x: torch.Tensor, batch: int = 128) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model.embed(x[i:i + batch]) for i in range(0, len(x), batch)])


def probe(model: nn.Module, data: tuple[torch.Tensor, ...]) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler
    x_tr, y_tr, x_te, y_te = data
    f_tr, f_te = features(model, x_tr).numpy(), features(model, x_te).numpy()
    scale = StandardScaler().fit(f_tr)
    clf = LogisticRegression(max_iter=1000).fit(scale.transform(f_tr), y_tr.numpy())
    return float(clf.score(scale.transform(f_te), y_te.numpy()))


def params_of(model: nn.Module, select=pointwise) -> int:
    return sum(p.numel() for n, m in model.named_modules() if select(n, m)
               for p in m.parameters())


def fine_tune(model: nn.Module, data: tuple[torch.Tensor, ...], steps: int, seed: int,
              lr: float) -> tuple[float, float]:
    """AdamW on the trainable parameters, batches of 32 (BatchNorm statistics frozen: eval
    mode); ``(test accuracy, seconds per step)``."""
    x_tr, y_tr, x_te, y_te = data
    gen = torch.Generator().manual_seed(seed)
    order = torch.randint(0, len(x_tr), (steps, 32), generator=gen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.eval()  # frozen BatchNorm statistics, as fine-tuning a small batch does
    start = time.perf_counter()
    for idx in order:
        loss = nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    per_step = (time.perf_counter() - start) / steps
    with torch.no_grad():
        logits = torch.cat([model(x_te[i:i + 256]) for i in range(0, len(x_te), 256)])
    return float((logits.argmax(1) == y_te).float().mean()), per_step


def with_head(classes: int = 10) -> mobilenet.MobileNetV2:
    torch.manual_seed(0)
    model = mobilenet.pretrained()
    model.classifier[1] = nn.Linear(1280, classes)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version")
    args = parser.parse_args(argv)
    started = time.time()
    n_train, n_test, steps = (64, 64, 2) if args.smoke else (3000, 1000, 150)
    size = 32 if args.smoke else SIZE
    images, labels = assets.fashion_mnist("train", n_train)
    test_images, test_labels = assets.fashion_mnist("test", n_test)
    data = (mobilenet.fashion_inputs(images, size), labels,
            mobilenet.fashion_inputs(test_images, size), test_labels)
    model = mobilenet.pretrained()
    dense = params_of(model)
    rows = [("original", f"{dense:,}", probe(model, data), 0.0, "-")]
    reference = features(model, data[2])  # the original's test features, for the distances
    batches = [data[0][i:i + 32] for i in range(0, min(256, n_train), 32)]
    formats = ("low_rank", "tucker2") if args.smoke else ("low_rank", "cp", "tucker2", "tt", "tr")
    # the output compress keeps: ImageNet's logits (the model as it is), or the pooled features
    # the probe reads (``run=``), which is what a transfer user keeps
    summaries = []
    for label, run, more in (("logits", None, {}), ("pooled features", _pooled, {}),
                             ("pooled features, sequential, healed (200 steps)", _pooled,
                              {"sequential": True, "heal": 2 if args.smoke else 200}),
                             # no layer cut below a third, or every layer at a half: what the
                             # probe loses to is the deep cuts the allocation makes
                             ("pooled features, shares 0.35-0.75", _pooled,
                              {"shares": (0.35, 0.5, 0.75)}),
                             ("pooled features, every layer at 50% (shares=(0.5,))", _pooled,
                              {"shares": (0.5,)})):
        t = time.time()
        small, report = tnspec.compress(copy.deepcopy(model), 0.5, data=batches,
                                        include=pointwise, formats=formats, run=run,
                                        max_seconds=240, **more)
        summaries.append(f"- keeping the {label}: {report.unfitted} candidates left unfitted, "
                         f"{report.pruned} pruned; chose "
                         + formats_chosen(report)
                         + "".join(f"; {line.strip()}" for line in str(report).splitlines()
                                   if line.strip().startswith(("sequential:", "healed:"))))
        seconds = time.time() - t
        rows.append((f"tnspec.compress with data, 50%, keeping the {label}",
                     f"{params_of(small, _replaced):,}", probe(small, data),
                     distance(reference, small, data[2]), f"{seconds:.0f}"))
    t = time.time()
    svd, _ = tnspec.tensorize(copy.deepcopy(model), "low_rank", rank=0.5, weights="fit",
                              include=pointwise, fit={"hops": 0, "starts": 1})
    seconds = time.time() - t
    rows.append(("truncated SVD per layer, 50%", f"{params_of(svd, _replaced):,}",
                 probe(svd, data), distance(reference, svd, data[2]), f"{seconds:.0f}"))
    print(rows, flush=True)

    tuned = []
    total = sum(p.numel() for p in model.parameters())
    share = 0.01 if not args.smoke else 0.02
    methods = ("head only", "low_rank", "PEFT LoRA") if args.smoke else \
        ("head only", "low_rank", "cp", "tucker2", "tt", "tr", "PEFT LoRA")
    for fmt in methods:
        net, trainable = with_adapters(fmt, share, init="zero")
        acc, per_step = fine_tune(net, data, steps, seed=0, lr=1e-3)
        tuned.append((fmt, f"{trainable:,} ({trainable / total:.2%})", acc,
                      f"{1000 * per_step:.0f}"))
        print(tuned[-1], flush=True)
    text = ("# MobileNetV2 (ImageNet) on Fashion-MNIST\n\n"
            f"{n_train:,} training / {n_test:,} test images at {size}x{size}, repeated to 3 "
            "channels, normalized as for ImageNet.\n\n"
            "## Frozen features, logistic-regression probe\n\n"
            "Parameters: the 1x1 convs of the features (the layers replaced).\n\n"
            + markdown_table(["features", "1x1 conv parameters", "probe accuracy",
                              "feature distance (test)", "seconds"], rows)
            + "\n\nFeature distance: the pooled features' relative L2 distance to the original's "
            "on the test images (what `compress` keeping the pooled features minimizes, on its "
            "256 images)."
            + "\n\ncompress (max_seconds=240):\n" + "\n".join(summaries)
            + f"\n\n## Fine-tuning, {steps} steps of 32 (AdamW 1e-3), the head trained in full"
            "\n\n" + markdown_table(["adapters on the 1x1 convs", "trainable",
                                     "test accuracy", "ms per step"], tuned))
    print(text)
    if not args.smoke:  # a smoke run writes nothing
        print(f"wrote {save('mobilenet_fashion', text, started)}")
    return 0


def with_adapters(method: str, share: float, init: str | None = None,
                  rank: int | None = None) -> tuple[nn.Module, int]:
    """The network with a new head and ``method``'s adapters on its 1x1 convs (a tnspec
    format, with ``init`` or ``adapt``'s default; ``"PEFT LoRA"`` at the nearest rank; or
    ``"head only"``), the adapters and head together about ``share`` of the ImageNet network's
    parameters; and its trainable parameters. ``rank``: a tnspec format at that integer rank
    on every 1x1 conv instead (``share`` then does not apply to it)."""
    net = with_head()
    total = sum(p.numel() for p in mobilenet.pretrained().parameters())
    dense = params_of(net)
    head = 1280 * 10 + 10
    budget = share * total  # adapters and head together
    if method == "head only":
        net.requires_grad_(False)
        net.classifier[1].requires_grad_(True)
    elif method == "PEFT LoRA":
        import peft
        names = [n for n, m in net.named_modules() if pointwise(n, m)]
        per_rank = sum(m.in_channels + m.out_channels for n, m in net.named_modules()
                       if pointwise(n, m))
        r = max(1, round((budget - head) / per_rank))
        net = peft.get_peft_model(net, peft.LoraConfig(
            r=r, lora_alpha=r, target_modules=names, modules_to_save=["classifier.1"]))
    else:
        net, _ = tnspec.adapt(net, method, rank=rank or (budget - head) / dense,
                              include=pointwise,
                              modules_to_save=["classifier.1"],
                              **({} if init is None else {"init": init}))
    return net, sum(p.numel() for p in net.parameters() if p.requires_grad)


def distance(reference: torch.Tensor, small: nn.Module, x: torch.Tensor) -> float:
    """The relative L2 distance of ``small``'s pooled features on ``x`` to ``reference``, the
    original's."""
    return float((features(small, x) - reference).norm() / reference.norm())


def _pooled(model: mobilenet.MobileNetV2, x: torch.Tensor) -> torch.Tensor:
    return model.embed(x)


def _replaced(name: str, module: nn.Module) -> bool:
    """The modules standing where the 1x1 convs were (tnspec layers, or convs kept dense)."""
    return name.startswith("features.") and (
        isinstance(module, tnspec.Layer) or pointwise(name, module))


if __name__ == "__main__":
    raise SystemExit(main())
