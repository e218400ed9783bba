"""Draw a network as a Graphviz graph: the paper's hypergraph, with its dummy tensors.

Operands are nodes (the input and output as ellipses, cores as boxes). An index on two
operands is an edge labelled with its name and size; an index on three or more (a hyperedge,
such as phi) is a small black node joined to every operand carrying it; each convolution
relation is a dummy-tensor node P joining the input (labelled with the affine term), the
core(s) carrying the kernel and the output.
"""

from __future__ import annotations

import shutil
import subprocess

from ..errors import SpecError
from ..ir import Network, Tensor


def to_dot(net: Network) -> str:
    """The DOT source of ``net``'s hypergraph."""
    operands = [net.input, *net.cores, net.output]
    sizes = net.sizes
    lines = [f"graph {_quote(net.name or 'network')} {{",
             "  graph [rankdir=LR, fontname=Helvetica];",
             "  node [fontname=Helvetica]; edge [fontname=Helvetica, fontsize=10];"]
    for t in operands:
        shape = "box" if t in net.cores else "ellipse"
        lines.append(f"  {_quote(t.name)} [shape={shape}, label={_quote(_label(t))}];")
    conv_names: set[str] = set()
    for k, conv in enumerate(net.convs):
        node = f"P{k}:{conv.target}"
        conv_names |= {conv.source, conv.target} | ({conv.kernel} if conv.kernel else set())
        lines.append(f"  {_quote(node)} [shape=diamond, label={_quote('P ' + conv.target)}, "
                     "style=filled, fillcolor=lightgrey];")
        for t in operands:
            for index, label in ((conv.source, conv.text), (conv.kernel, conv.kernel),
                                 (conv.target, conv.target)):
                if index and index in t.indices:
                    lines.append(f"  {_quote(t.name)} -- {_quote(node)} [label={_quote(label)}];")
    for ix in net.indices:
        if ix.name in conv_names:
            continue
        holders = [t.name for t in operands if ix.name in t.indices]
        label = _quote(f"{ix.name}={sizes[ix.name]}" if ix.name in sizes else ix.name)
        if len(holders) == 2:
            lines.append(f"  {_quote(holders[0])} -- {_quote(holders[1])} [label={label}];")
        elif len(holders) > 2:
            hub = _quote(f"hyperedge:{ix.name}")
            lines.append(f"  {hub} [shape=point, width=0.12, xlabel={label}];")
            lines += [f"  {_quote(h)} -- {hub};" for h in holders]
    lines.append("}")
    return "\n".join(lines) + "\n"


#: the formats Graphviz renders for ``tnspec draw`` (by the output's suffix)
RENDERED = (".svg", ".png", ".pdf")


def render(dot: str, fmt: str) -> bytes:
    """DOT source rendered by Graphviz's ``dot`` program to ``fmt`` (svg, png or pdf)."""
    exe = shutil.which("dot")
    if exe is None:
        raise SpecError(f"{fmt.upper()} output needs Graphviz's `dot` program, which is not on "
                        "PATH", hint="install Graphviz (e.g. apt install graphviz), or write a "
                        ".dot file and render it elsewhere")
    result = subprocess.run([exe, f"-T{fmt}"], input=dot.encode("utf-8"), capture_output=True,
                            timeout=60)
    if result.returncode != 0:
        raise SpecError(f"Graphviz failed: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


def _label(t: Tensor) -> str:
    axes = ", ".join(" ".join(a) if len(a) == 1 else f"({' '.join(a)})" for a in t.axes)
    return f"{t.name}[{axes}]"


def _quote(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
