"""Tensorized embeddings: ``nn.Embedding`` and ``nn.EmbeddingBag`` as networks with an index
input (``x[b] in (v0 v1 v2)``), built on :class:`~tnspec.nn.module.Layer`.

:func:`embedding_format` writes the spec of a named format over the vocabulary and the
embedding dimension, each split into modes; :func:`embedding` builds the layer (its
``forward`` is the layer's generated code, so ``tnspec compile`` writes the same);
:class:`EmbeddingBag` reduces the layer's rows per bag as ``F.embedding_bag`` does.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..errors import SpecError
from ..language.settings import positive_int
from .formats import NAMES, Format

__all__ = ["EMBEDDING_FORMATS", "EmbeddingBag", "TiedHead", "embedding", "embedding_bag",
           "embedding_format"]

#: the named formats, each as the cores over modes v_k, d_k and ranks r_k (n modes)
EMBEDDING_FORMATS = ("tt", "tr", "cp", "tucker")


def split(n: int, parts: int) -> tuple[int, ...]:
    """``parts`` near-equal factors whose product is ``n`` or, where ``n`` has no balanced
    factoring, the least number above it that has one (the extra rows are never read)."""
    n = _positive(n, "size")
    for m in range(n, n + n // 8 + 16):
        factors = _balanced(m, parts)
        if max(factors) <= 1.5 * m ** (1 / parts) + 1:
            return tuple(sorted(factors, reverse=True))
    return _balanced(n, parts)  # pragma: no cover (some m above always factors)


def _balanced(m: int, parts: int) -> tuple[int, ...]:
    if parts == 1:
        return (m,)
    target = m ** (1 / parts)
    divisors = [d for d in range(1, math.isqrt(m) + 1) if m % d == 0]
    divisors += [m // d for d in divisors]
    d = min(divisors, key=lambda d: (abs(math.log(d / target)), d))
    return (d, *_balanced(m // d, parts - 1))


def embedding_format(fmt: str, num_embeddings: int, embedding_dim: int, *,
                     rank: int | float = 8, modes: int | tuple[Sequence[int], Sequence[int]]
                     = 3) -> Format:
    """The spec and sizes of a ``fmt`` embedding (tt, tr, cp, tucker): the vocabulary and the
    dimension each split into ``modes`` near-equal modes (or ``modes=(vocabulary modes,
    dimension modes)``), every rank ``rank`` (or a float in (0, 1]: the largest equal rank
    whose cores have at most that fraction of the table's parameters).

    >>> embedding_format("tt", 1000, 64, rank=8).spec
    'x[b] in (v0 v1 v2), G0[v0, d0, r0], G1[r0, v1, d1, r1], G2[r1, v2, d2] -> y[b, (d0 d1 d2)]'
    """
    if fmt not in EMBEDDING_FORMATS:
        raise SpecError(f"{fmt} has no embedding form: an embedding's formats are "
                        f"{', '.join(EMBEDDING_FORMATS)}" if fmt in NAMES else
                        f"unknown embedding format {fmt!r}",
                        hint=f"choose one of {', '.join(EMBEDDING_FORMATS)}, or write a spec "
                        "with an index input, e.g. 'x[b] in (v0 v1), A[v0, d0, r], "
                        "B[r, v1, d1] -> y[b, (d0 d1)]'")
    if isinstance(modes, int):
        _positive(modes, "modes")
        vs, ds = split(num_embeddings, modes), split(embedding_dim, modes)
        if math.prod(ds) != embedding_dim:
            ds = _balanced(embedding_dim, modes)
    else:
        pair = isinstance(modes, Sequence) and len(modes) == 2 and all(
            isinstance(m, Sequence) and all(positive_int(n) for n in m) for m in modes)
        if not pair:
            raise SpecError(f"modes={modes!r} is neither a number of modes nor a pair of "
                            "mode tuples", hint="e.g. modes=3, or modes=((10, 10, 10), "
                            "(4, 4, 4)) for the vocabulary's and the dimension's modes")
        vs, ds = (tuple(int(n) for n in m) for m in modes)
        if len(vs) != len(ds) or math.prod(vs) < num_embeddings or \
                math.prod(ds) != embedding_dim:
            raise SpecError(f"modes {modes!r} do not fit {num_embeddings} x {embedding_dim}",
                            hint="give (vocabulary modes, dimension modes) of one length, "
                            "the first with a product of at least num_embeddings, the second "
                            "of exactly embedding_dim")
    n = len(vs)

    def make(r: int) -> Format:
        sizes = {f"v{k}": v for k, v in enumerate(vs)}
        if fmt != "tucker":
            sizes.update({f"d{k}": d for k, d in enumerate(ds)})
        if fmt == "tucker":
            cores = [f"U{k}[v{k}, s{k}]" for k in range(n)]
            cores.append(f"C[{', '.join(f's{k}' for k in range(n))}, d]")
            sizes.update({f"s{k}": min(r, vs[k]) for k in range(n)}, d=embedding_dim)
            out = "d"
        else:
            out = "(" + " ".join(f"d{k}" for k in range(n)) + ")"
            if fmt == "cp":
                cores = [f"G{k}[v{k}, d{k}, r]" for k in range(n)]
                sizes["r"] = r
            else:
                ring = fmt == "tr"
                edges = n if ring else n - 1
                left = [f"r{(k - 1) % n}" if ring or k else None for k in range(n)]
                right = [f"r{k}" if ring or k < n - 1 else None for k in range(n)]
                cores = [f"G{k}[" + ", ".join(i for i in (left[k], f"v{k}", f"d{k}", right[k])
                                              if i) + "]" for k in range(n)]
                sizes.update({f"r{k}": r for k in range(edges)})
        spec = (f"x[b] in ({' '.join(f'v{k}' for k in range(n))}), " + ", ".join(cores) +
                f" -> y[b, {out}]")
        return Format(spec, sizes)

    if isinstance(rank, float) and not isinstance(rank, bool):
        if not 0 < rank <= 1:
            raise SpecError(f"rank={rank} as a fraction must lie in (0, 1]",
                            hint="an int for the rank itself")
        budget = rank * num_embeddings * embedding_dim
        r = 1
        while r < 4096 and _parameters(make(r + 1)) <= budget:
            r += 1
        return make(r)
    return make(_positive(rank, "rank"))


def _positive(value: Any, what: str) -> int:
    n = positive_int(value)
    if n is None:
        raise SpecError(f"{what}={value!r} is not a positive integer", hint=f"e.g. {what}=8")
    return n


def _parameters(fmt: Format) -> int:
    from .api import compile
    return compile(fmt.spec, sizes=fmt.sizes).num_parameters


def embedding(fmt: str, num_embeddings: int, embedding_dim: int, *, rank: int | float = 8,
              padding_idx: int | None = None, modes: Any = 3, std: float = 1.0,
              **options: Any) -> Any:
    """A tensorized ``nn.Embedding``: a :class:`~tnspec.nn.module.Layer` whose input holds
    indices (any integer tensor, as ``nn.Embedding`` takes) and whose output adds one axis of
    ``embedding_dim``. ``fmt`` is tt, tr, cp or tucker (see :func:`embedding_format` for
    ``rank`` and ``modes``), or a spec with an index input (its sizes as keyword ``options``).
    The layer has ``num_embeddings``, ``embedding_dim`` and ``padding_idx`` (whose row is zero
    and gets no gradient), and ``dense_weight()`` is the ``(num_embeddings, embedding_dim)``
    table. Its rows start N(0, ``std``^2), as ``nn.Embedding``'s (Graph-in for an index input).
    Other ``options`` go to :func:`tnspec.layer` (dtype, device, init, ...).

    >>> emb = embedding("tt", 1000, 64, rank=8)
    >>> emb(torch.tensor([[1, 2], [3, 999]])).shape
    torch.Size([2, 2, 64])
    """
    from .api import layer
    num_embeddings = _positive(num_embeddings, "num_embeddings")
    embedding_dim = _positive(embedding_dim, "embedding_dim")
    if not (isinstance(std, (int, float)) and 0 < std < math.inf):
        raise SpecError(f"std={std!r} is not a positive number", hint="e.g. std=1.0")
    if "[" in fmt:
        spec, sizes = fmt, {k: options.pop(k) for k in list(options)
                            if k not in _LAYER_OPTIONS}
    else:
        spec, sizes = embedding_format(fmt, num_embeddings, embedding_dim, rank=rank,
                                       modes=modes)
    text = _file(spec, num_embeddings, _padding(padding_idx, num_embeddings))
    if std != 1.0:  # Graph-in gives Var(y) = 1 / p_a: the scale is the "activation"
        options["activation"] = float(std) ** -2.0
    module = layer(text, sizes=sizes, **options)
    if not module.network.lookup or module.embedding_dim != embedding_dim or \
            module.network.vocabulary != num_embeddings:
        raise SpecError(f"{spec!r} does not look up {num_embeddings} x {embedding_dim} rows",
                        hint="write the data as x[b] in (modes...) with modes of at least "
                        "num_embeddings indices, and output modes of embedding_dim")
    return module


_LAYER_OPTIONS = frozenset({"init", "bias", "distribution", "init_weights", "dtype", "device",
                            "planner", "autotune", "max_elements", "max_bytes"})


def _padding(padding_idx: int | None, num_embeddings: int) -> int | None:
    """``padding_idx`` as ``nn.Embedding`` takes it (negative counts from the end)."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or \
            not -num_embeddings <= padding_idx < num_embeddings:
        raise SpecError(f"padding_idx={padding_idx!r} is not an index of {num_embeddings} rows",
                        hint=f"an int in [-{num_embeddings}, {num_embeddings})")
    return padding_idx % num_embeddings


def _file(spec: str, num_embeddings: int, padding_idx: int | None) -> str:
    """``spec`` as a one-layer ``.tn`` text carrying the vocabulary options."""
    lines = [f"    num_embeddings: {num_embeddings}"]
    if padding_idx is not None:
        lines.append(f"    padding_idx: {padding_idx}")
    return "layer embedding {\n" + "\n".join(lines) + f"\n    {spec}\n}}\n"


class EmbeddingBag(nn.Module):
    """``nn.EmbeddingBag`` over a tensorized embedding ``rows`` (see :func:`embedding`): sums,
    means or maxima of the rows of each bag, with the signature and semantics of
    ``F.embedding_bag``: a 2-D ``input`` is one bag per row; a 1-D one is cut into bags at
    ``offsets``; ``per_sample_weights`` (mode "sum") weighs each row; ``padding_idx``
    entries are left out (of the mean's count too); an empty bag is zeros."""

    def __init__(self, rows: nn.Module, mode: str = "mean") -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise SpecError(f"unknown mode {mode!r}", hint="mode is 'sum', 'mean' or 'max'")
        self.rows, self.mode = rows, mode
        self.num_embeddings = rows.num_embeddings
        self.embedding_dim = rows.embedding_dim
        self.padding_idx = rows.padding_idx

    def dense_weight(self) -> torch.Tensor:
        """The ``(num_embeddings, embedding_dim)`` table, differentiable in the cores."""
        return self.rows.dense_weight()

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() == 2:
            if offsets is not None:
                raise ValueError("offsets is for a 1-D input; a 2-D input is one bag per row")
            bags, length = input.shape
            bag = torch.arange(bags, device=input.device).repeat_interleave(length)
        elif input.dim() == 1:
            if offsets is None or offsets.dim() != 1:
                raise ValueError("a 1-D input needs 1-D offsets: where each bag starts")
            bags = offsets.shape[0]
            positions = torch.arange(input.shape[0], device=input.device)
            bag = torch.bucketize(positions, offsets.to(input.device), right=True) - 1
        else:
            raise ValueError(f"input must be 1-D (with offsets) or 2-D, got {input.dim()}-D")
        flat = input.reshape(-1)
        rows = self.rows(flat)
        if per_sample_weights is not None:
            if self.mode != "sum":
                raise ValueError("per_sample_weights is only for mode='sum'")
            rows = rows * per_sample_weights.reshape(-1, 1).to(rows.dtype)
        keep = torch.ones_like(flat, dtype=rows.dtype) if self.padding_idx is None else \
            (flat != self.padding_idx).to(rows.dtype)
        out = rows.new_zeros(bags, rows.shape[1])
        if self.mode == "max":
            rows = rows.masked_fill(keep[:, None] == 0, -math.inf)
            out = out.fill_(-math.inf).scatter_reduce(
                0, bag[:, None].expand_as(rows), rows, "amax", include_self=True)
            return out.masked_fill(torch.isinf(out), 0.0)
        out = out.index_add(0, bag, rows)
        if self.mode == "mean":
            count = rows.new_zeros(bags).index_add(0, bag, keep)
            out = out / count.clamp(min=1)[:, None]
        return out

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


class TiedHead(nn.Module):
    """A language model's output projection tied to a tensorized embedding ``table``: logits
    ``x @ table^T + bias``, read from the very cores the embedding looks its rows up in (as a
    dense head and embedding share one weight). The table is formed once per call."""

    def __init__(self, table: nn.Module, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.table = table  # the embedding's module: its cores are this head's parameters
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=bias.requires_grad)
        self.in_features, self.out_features = table.embedding_dim, table.num_embeddings

    @property
    def weight(self) -> torch.Tensor:
        """The ``(num_embeddings, embedding_dim)`` table, as the tied dense weight was."""
        return self.table.dense_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.table.dense_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
            f"bias={self.bias is not None}"


def embedding_bag(fmt: str, num_embeddings: int, embedding_dim: int, *, mode: str = "mean",
                  **kwargs: Any) -> EmbeddingBag:
    """A tensorized ``nn.EmbeddingBag``: :class:`EmbeddingBag` over
    ``embedding(fmt, num_embeddings, embedding_dim, **kwargs)``."""
    return EmbeddingBag(embedding(fmt, num_embeddings, embedding_dim, **kwargs), mode)


def replacing(module: nn.Embedding | nn.EmbeddingBag, format: str, rank: int | float,
              weights: str, error: float | None, fit: Mapping[str, Any]
              ) -> tuple[nn.Module, float | None]:
    """The tensorized embedding (or bag) standing in for ``module`` in ``tensorize`` (SpecError
    where none can), fitted to its table if asked; with the fit's relative error."""
    if error is not None:
        raise SpecError("error= chooses ranks for conv and linear layers; an embedding takes "
                        "rank=")
    for attr, plain in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False),
                        ("include_last_offset", False)):
        if getattr(module, attr, plain) != plain:
            raise SpecError(f"{attr}={getattr(module, attr)!r} has no tensorized counterpart")
    if type(module).forward not in (nn.Embedding.forward, nn.EmbeddingBag.forward):
        raise SpecError(f"{type(module).__name__} overrides forward: a layer of its weight "
                        "would not compute what it does")
    weight = module.weight
    rows = embedding(format, module.num_embeddings, module.embedding_dim, rank=rank,
                     padding_idx=module.padding_idx, dtype=weight.dtype, device=weight.device)
    fit_error = rows.fit_(weight.detach(), **fit) if weights == "fit" else None
    new = EmbeddingBag(rows, module.mode) if isinstance(module, nn.EmbeddingBag) else rows
    new.train(module.training)
    for p in new.parameters():
        p.requires_grad_(weight.requires_grad)
    return new, fit_error
