"""Write docs/api.md, the API reference, from tnspec's docstrings and signatures.

    python docs/make_api.py          # rewrites docs/api.md; tests/test_docs.py checks it is current
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tnspec  # noqa: E402
from tnspec import formats  # noqa: E402

OUT = Path(__file__).resolve().parent / "api.md"
HEADER = """# tnspec API reference

Generated from the docstrings by `python docs/make_api.py`; do not edit by hand (a test checks
that this file is current). Everything listed is exported by `tnspec` (`tnspec.__all__`) or by
`tnspec.formats`.
"""


def _signature(obj: object, name: str) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    return f"{name}{sig}"


def _entry(name: str, obj: object, level: str = "##") -> list[str]:
    doc = inspect.getdoc(obj) or "(no docstring)"
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
    lines = [f"{level} `{name}`", ""]
    if kind != "value":
        lines += ["```python", f"{'class ' if kind == 'class' else ''}"
                  f"{_signature(obj, name)}", "```", ""]
    lines += [doc, ""]
    if kind == "class":
        for attr, member in sorted(vars(obj).items()):
            # methods, and settings: properties and other data descriptors
            if attr.startswith("_") or not (inspect.isfunction(member) or
                                            inspect.isdatadescriptor(member)):
                continue
            target = member.fget if isinstance(member, property) else member
            lines += [f"### `{name}.{attr}`", ""]
            if inspect.isfunction(member):
                lines += ["```python", _signature(target, attr), "```", ""]
            lines += [inspect.getdoc(target) or "(no docstring)", ""]
    return lines


def render() -> str:
    """The text of docs/api.md."""
    lines = [HEADER]
    for name in sorted(tnspec.__all__, key=str.lower):
        obj = getattr(tnspec, name)
        if name in ("formats", "__version__") or inspect.ismodule(obj):
            continue
        lines += _entry(f"tnspec.{name}", obj)
    lines += ["## `tnspec.formats`", "", inspect.getdoc(formats) or "", ""]
    for name in ("build", *formats.NAMES, "random"):
        lines += _entry(f"tnspec.formats.{name}", getattr(formats, name), "###")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
