"""The package is grouped by stage and imports one way: no module imports a later stage, no cycle
(typing-only imports included), no module over ~400 lines, no package over 14 modules, a short
top level, the two families of workflows apart, and ``import tnspec`` loads neither dynamo nor
any interpreter of programs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tnspec"

#: the stages in import order: a module may import its own stage and the ones before it
STAGES = ("language", "analysis", "fit", "planning", "emit", "nn", "workflows")
#: the top level: the plain data passed between stages sit below every stage, the entry points
#: (the command line, the package itself) above every stage
DATA = frozenset({"ir", "program", "shapes", "errors", "progress", "_version"})
ENTRY = frozenset({"cli", "__init__", "__main__"})
MAX_LINES = 400
MAX_MODULES = 14
#: the workflows' two families: neither imports the other; what both need sits in
#: ``workflows/`` itself, which imports neither (docs/architecture.md, "Rules for workflows")
FAMILIES = ("workflows.convert", "workflows.adapters")
#: every package (a folder with an ``__init__.py``), by module name
PACKAGES = frozenset(".".join(p.parent.relative_to(PACKAGE).parts)
                     for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def module_name(path: Path) -> str:
    """``language.parse`` for tnspec/language/parse.py, ``ir`` for tnspec/ir.py."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    """The tnspec modules a ``from ... import`` names (module names as :func:`module_name`)."""
    if node.level == 0:
        if not (node.module or "").startswith("tnspec"):
            return []
        base = node.module.split(".")[1:]
    else:
        here = importer.split(".") if importer not in ("__init__", "__main__") else []
        package = here if is_package else here[:-1]
        base = package[:len(package) - (node.level - 1)] + \
            (node.module.split(".") if node.module else [])
    if not base:  # ``from tnspec import X`` / ``from . import X`` at the top
        return [a.name for a in node.names]
    target = ".".join(base)
    if target in PACKAGES:  # ``from .nn import formats``: submodules of a package
        return [f"{target}.{a.name}" for a in node.names]
    return [target]


def imports(typing: bool = True) -> dict[str, dict[str, int]]:
    """Module -> {tnspec module it imports: line}, function-level imports included, and those
    under ``if TYPE_CHECKING:`` unless ``typing`` is False."""
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        deps: dict[str, int] = {}
        tree = ast.parse(path.read_text())
        typed = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and
                 ast.unparse(block.test) == "TYPE_CHECKING" for n in ast.walk(block)}
        for node in ast.walk(tree):
            if not typing and id(node) in typed:
                continue
            if isinstance(node, ast.ImportFrom):
                for dep in resolve(name, path.name == "__init__.py", node):
                    deps.setdefault(dep, node.lineno)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("tnspec."):
                        deps.setdefault(a.name.split(".", 1)[1], node.lineno)
        deps.pop(name, None)
        graph[name] = deps
    return graph


def rank(module: str) -> int:
    """Where a module sits: the data 0, stages 1-7 in order, the entry points last."""
    head = module.split(".")[0]
    if head in STAGES:
        return 1 + STAGES.index(head)
    if head in DATA:
        return 0
    assert head in ENTRY, f"tnspec/{head}.py belongs to no stage: add it to a stage package"
    return len(STAGES) + 1


def later_stage_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import of a later stage, as ``tnspec/a/b.py:LINE imports tnspec.c.d (...)``."""
    bad = []
    for module, deps in graph.items():
        for dep, line in sorted(deps.items()):
            if rank(dep) > rank(module):
                where = module.replace(".", "/") + (".py" if module not in STAGES else
                                                    "/__init__.py")
                bad.append(f"tnspec/{where}:{line} imports tnspec.{dep}, a later stage "
                           f"({dep.split('.')[0]} comes after {module.split('.')[0]})")
    return bad


def family(module: str) -> str | None:
    """The workflow family a module belongs to, ``"workflows"`` for what they share, or None."""
    for name in FAMILIES:
        if module == name or module.startswith(name + "."):
            return name
    return "workflows" if module.split(".")[0] == "workflows" else None


def cross_family_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each import of one workflow family by the other, or of either by what they share."""
    bad = []
    for module, deps in graph.items():
        mine = family(module)
        for dep, line in sorted(deps.items()):
            theirs = family(dep)
            if mine and theirs in FAMILIES and theirs != mine:
                where = module.replace(".", "/") + ("/__init__.py" if module in PACKAGES
                                                    else ".py")
                what = ("the workflows' shared floor imports" if mine == "workflows" else
                        f"{mine.split('.')[1]} imports")
                bad.append(f"tnspec/{where}:{line}: {what} tnspec.{dep}, of the "
                           f"{theirs.split('.')[1]} family (move what both need to "
                           "tnspec/workflows/)")
    return bad


def test_no_module_imports_a_later_stage():
    bad = later_stage_imports(imports())
    assert not bad, "imports must run down the stages (docs/architecture.md):\n" + "\n".join(bad)


def test_the_stage_check_names_a_reversed_import():
    """The check itself: an import of nn from planning is caught and named."""
    graph = imports()
    graph["planning.plan"] = {**graph["planning.plan"], "nn.module": 7}
    graph["ir"] = {**graph["ir"], "language.parse": 3}
    assert later_stage_imports(graph) == [
        "tnspec/ir.py:3 imports tnspec.language.parse, a later stage (language comes after ir)",
        "tnspec/planning/plan.py:7 imports tnspec.nn.module, a later stage (nn comes after "
        "planning)"]


def test_the_workflow_families_import_only_what_they_share():
    bad = cross_family_imports(imports())
    assert not bad, "\n".join(bad)


def test_the_family_check_names_a_crossing_import():
    graph = imports()
    graph["workflows.adapters.adapt"] = {**graph["workflows.adapters.adapt"],
                                         "workflows.convert.tensorize": 9}
    graph["workflows.adapted"] = {**graph["workflows.adapted"], "workflows.adapters.state": 4}
    assert cross_family_imports(graph) == [
        "tnspec/workflows/adapted.py:4: the workflows' shared floor imports "
        "tnspec.workflows.adapters.state, of the adapters family (move what both need to "
        "tnspec/workflows/)",
        "tnspec/workflows/adapters/adapt.py:9: adapters imports "
        "tnspec.workflows.convert.tensorize, of the convert family (move what both need to "
        "tnspec/workflows/)"]


def test_no_import_cycle_typing_imports_included():
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


def test_every_import_names_a_module_that_exists():
    graph = imports()
    missing = {f"{m} -> {d}" for m, deps in graph.items() for d in deps if d not in graph}
    assert not missing


def test_layout_short_top_level_and_small_modules():
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert set(top) == DATA | ENTRY, top
    assert len(top) <= 10
    assert sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and
                  (p / "__init__.py").exists()) == sorted(STAGES)
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: split them along a seam: {long}"
    crowded = {package: n for package in PACKAGES
               if (n := len(list((PACKAGE / package.replace(".", "/")).glob("*.py"))) - 1)
               > MAX_MODULES}
    assert not crowded, f"packages over {MAX_MODULES} modules: give a family its room: {crowded}"


def test_stages_import_only_what_they_need():
    """Finer than the stage order: the data model imports no stage, and modules that are plain
    data or a file stay free of the machinery around them."""
    graph = {m: set(d) for m, d in imports().items()}
    assert graph["ir"] == set()
    assert graph["errors"] == set()
    assert graph["shapes"] <= {"ir", "errors"}
    assert graph["program"] <= {"ir", "shapes"}
    assert graph["analysis.backward"] <= {"ir"}
    assert graph["planning.problem"] <= {"ir", "planning.cost"}
    assert graph["planning.paths"] <= {"ir", "errors", "planning.problem"}
    # an index input is planned and lowered by lookup, which plan and lower hand it to
    assert graph["planning.plan"] <= {"ir", "errors", "shapes", "planning.cost",
                                      "planning.problem", "planning.paths", "planning.lookup"}
    assert graph["planning.lookup"] <= {"ir", "errors", "shapes", "program",
                                        "planning.cost"}  # no Lark
    assert graph["emit.products"] <= {"ir", "program", "shapes", "planning.plan"}  # of lower
    assert graph["planning.measure"] <= {"planning.cost"}
    assert graph["planning.calibration"] <= {"progress", "planning.cache", "planning.choices",
                                             "planning.cost", "planning.measure"}
    assert graph["planning.choices"] == set()  # plain text about cached entries
    assert graph["planning.cache"] == set()  # the file alone: no model, no torch
    assert graph["fit.moments"] <= {"errors"}
    assert graph["nn.embedding"] <= {"errors", "language.settings", "nn.api", "nn.formats"}
    # the model's memory format: measured as the layers' own orders are, no pipeline stage
    assert graph["nn.layout"] <= {"errors", "planning.calibration", "nn.autotune"}
    # the workflows' shared floor: plain module-tree work, knowing no workflow
    assert graph["workflows.dense_layers"] <= {"errors", "workflows.padded"}
    assert graph["workflows.padded"] == set()  # reading a conv's forward: torch alone
    assert graph["workflows.model_tree"] == set()
    assert graph["workflows.feeding"] <= {"errors"}  # running a model on a batch, nothing more
    assert graph["workflows.stand_ins"] <= {"nn.module"}
    assert graph["workflows.left_alone"] <= {"workflows.dense_layers", "workflows.model_tree"}
    # the adapted module reads its adapter's network (ir) to run it less its copy as one
    assert graph["workflows.adapted"] <= {"errors", "fit.decompose", "ir", "nn.module",
                                          "nn.modes", "workflows.padded", "workflows.stand_ins"}
    # adapters: above Layer, they build layers through the API and plan nothing
    adapters = {m: d for m, d in graph.items() if m.startswith("workflows.adapters.")}
    assert not {d for deps in adapters.values() for d in deps
                if d.startswith(("planning.", "emit."))}
    assert not {d for d in graph["workflows.adapters.layers"]
                if d.startswith("workflows.adapters.")}
    # the step rule: a parametrization of an adapter's cores, knowing no workflow
    assert graph["workflows.adapters.step_rule"] <= {"errors", "nn.module"}
    assert graph["workflows.adapters.lora_export"] <= {"errors", "workflows.adapted",
                                                       "workflows.dense_layers",
                                                       "workflows.padded"}
    assert graph["workflows.adapters.hotswap"] <= {"errors", "workflows.adapted",
                                                   "workflows.adapters.state",
                                                   "workflows.adapters.step_rule"}
    assert graph["workflows.adapters.peft_bridge"] <= {"errors", "workflows.adapted",
                                                       "workflows.adapters.layers",
                                                       "workflows.dense_layers"}
    # conversion: what a model feeds its layers is observed without knowing a format
    assert graph["workflows.convert.observe"] <= {"errors", "fit.moments",
                                                  "workflows.dense_layers",
                                                  "workflows.feeding",
                                                  "workflows.convert.replay"}
    assert graph["workflows.convert.replay"] == set()  # torch alone: knows no tnspec
    assert graph["workflows.convert.activations"] <= {"workflows.dense_layers"}
    assert "__init__" not in set().union(*(d for m, d in graph.items() if m != "__main__"))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_import_nothing(package):
    """A package's ``__init__`` is its description only: importing one stage loads no other."""
    assert imports()[package] == {}


def test_import_loads_no_dynamo_and_architecture_lists_every_module():
    code = "import sys, tnspec; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "False", out.stderr
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for path in PACKAGE.rglob("*.py"):
        if path.stem not in ("__init__", "__main__", "_version"):
            assert f"`{path.relative_to(PACKAGE).as_posix()}`" in doc, path
