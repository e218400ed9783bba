"""The pipeline imports one way: no cycle among tnspec's modules, the IR imports no stage, and
``import tnspec`` loads neither dynamo nor any interpreter of programs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tnspec"


def imports() -> dict[str, set[str]]:
    """Module -> the tnspec modules it imports, function-level imports included."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else \
                    {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tnspec"):
                deps.add(node.module.split(".")[1] if "." in node.module else "__init__")
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names
                         if a.name.startswith("tnspec.")}
        graph[path.stem] = deps
    return graph


def test_no_module_imports_a_later_stage():
    graph = imports()
    state: dict[str, int] = {}

    def visit(mod: str, trail: list[str]) -> None:
        assert state.get(mod) != 1, "import cycle: " + " -> ".join(trail + [mod])
        if state.get(mod) == 2:
            return
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            visit(dep, trail + [mod])
        state[mod] = 2
    for mod in graph:
        visit(mod, [])


def test_stages_import_only_what_lies_above_them():
    graph = imports()
    assert graph["ir"] == set()
    assert graph["shapes"] <= {"ir", "errors"}
    assert graph["backward"] <= {"ir"}
    assert graph["problem"] <= {"ir", "cost"}
    assert graph["paths"] <= {"ir", "errors", "problem"}
    # an index input is planned and lowered by lookup, which plan and lower hand it to
    assert graph["plan"] <= {"ir", "errors", "cost", "shapes", "problem", "paths", "lookup"}
    assert graph["lookup"] <= {"ir", "errors", "cost", "shapes", "program"}  # no Lark
    assert graph["shapes"] <= {"ir", "errors"}
    assert graph["products"] <= {"plan", "program", "shapes"}  # a part of lower
    assert graph["measure"] <= {"cost"}
    assert graph["calibration"] <= {"cache", "choices", "cost", "measure", "progress"}
    assert graph["choices"] == set()  # plain text about cached entries
    assert graph["cache"] == set()  # the file alone: no model, no torch
    # workflows above Layer: adapters build layers through the API, they plan nothing
    assert graph["adapters"] <= {"api", "convert", "decompose", "dense", "errors", "formats",
                                 "init", "ir", "module", "parse", "shapes"}
    assert graph["adapter_state"] <= {"adapters", "api", "dense", "errors"}
    assert graph["peft_bridge"] <= {"adapters"}
    assert graph["moments"] <= {"errors"}
    assert graph["observe"] <= {"errors", "moments"}
    assert graph["embedding"] <= {"api", "errors", "formats", "settings"}
    # the model's memory format: measured as the layers' own orders are, no pipeline stage
    assert graph["layout"] <= {"autotune", "calibration", "errors"}
    assert graph["compress"] <= {"convert", "dense", "errors", "module", "observe", "progress"}
    assert "__init__" not in set().union(*(d for m, d in graph.items() if m != "__main__"))


def test_import_loads_no_dynamo_and_readme_layout_lists_every_module():
    code = "import sys, tnspec; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "False", out.stderr
    readme = (PACKAGE.parent / "README.md").read_text()
    for path in PACKAGE.glob("*.py"):
        if path.stem not in ("__init__", "__main__", "_version"):
            assert f"tnspec/{path.name}" in readme, path.name
