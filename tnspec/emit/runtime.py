"""Runtime: load generated source as live code (the one executor), and find a layer's
class when ``torch.compile`` traces it.

As ``torch.fx.GraphModule`` does, an inline layer does not interpret its plan: it executes
the source that ``codegen`` prints for it, the text ``tnspec compile`` would write. Each
distinct source is compiled once and kept in a bounded cache, under a file name registered
with :mod:`linecache`, so that tracebacks, ``pdb`` and profilers show the generated lines.
"""

from __future__ import annotations

import dis
import hashlib
import itertools
import linecache
import weakref
from collections import OrderedDict
from typing import Any, Callable

from ..ir import Network
from ..planning.plan import Plan
from . import codegen, weights
from .lower import lower

#: compiled modules kept (each is a few functions); the oldest is dropped beyond this
CACHE_SIZE = 512
_cache: "OrderedDict[str, type]" = OrderedDict()


def load_class(source: str, name: str) -> type:
    """The class ``name`` defined by ``source``, compiled once per distinct source."""
    key = hashlib.sha1(source.encode()).hexdigest()[:16]
    if key in _cache:
        _cache.move_to_end(key)
        return _cache[key]
    filename = f"<tnspec-generated-{key}>"
    lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace: dict[str, Any] = {}  # no __name__: dynamo would try to import it
    exec(compile(source, filename, "exec"), namespace)  # our own codegen's output
    cls = namespace[name]
    _cache[key] = cls
    if len(_cache) > CACHE_SIZE:
        old, _ = _cache.popitem(last=False)
        linecache.cache.pop(f"<tnspec-generated-{old}>", None)
    return cls


def layer_class(network: Network, plan: Plan | None, channels_last: bool = False,
                convert: bool = False, compiled: bool = False) -> type:
    """The generated class of one layer, with the ``forward`` of ``plan`` (laid out for a
    channels-last input if asked, or converting to channels-last inside, in the form
    ``torch.compile`` traces if ``compiled``: see ``lower``) when one is given. The class keeps
    how it was lowered (``lowered``), so that the compiled form of the same choice can be made
    (:func:`compiled_form`)."""
    program = None if plan is None else lower(plan, channels_last, convert, compiled)
    layer = codegen.LayerCode(network, None) if program is None else \
        codegen.LayerCode(network, program, codegen.summary_line(plan))
    source = codegen.generate([layer])
    cls = load_class(source, codegen.class_name(network))
    cls.lowered = (network, plan, convert, compiled)
    # the data meets the cores through one weight, or through a chain of two (see weights)
    split = None if program is None else weights.built_from_cores(program)
    cls.alone = program is not None and weights.alone(program, split)
    cls.chain = program is not None and not cls.alone and bool(weights.chain(program, split))
    cls.applied = weights.applied(program, split) if cls.alone else None  # the op's name
    return cls


def compiled_form(cls: type, channels_last: bool) -> type:
    """The class ``torch.compile`` should trace for the eager class ``cls`` run on an input
    laid out ``channels_last`` or not: the same plan and op choices, lowered in the compiled
    form (made once per class and layout). The layout is asked, not read off the class: one
    eager source can serve both layouts, where the compiled forms differ."""
    network, plan, convert, compiled = cls.lowered
    if compiled or plan is None:
        return cls
    forms = vars(cls).get("compiled_forms")
    if forms is None:
        forms = cls.compiled_forms = {}
    if channels_last not in forms:
        forms[channels_last] = layer_class(network, plan, channels_last, convert, compiled=True)
    return forms[channels_last]


def fingerprint(*classes: type, rename: Callable[[str], str] = str) -> str:
    """A digest of what the ``forward`` of ``classes`` computes: the instructions in order
    with their names and constants, not comments or line numbers (which carry FLOP counts of
    the shape it was planned for). Two builds of tnspec that lower an order differently give
    different fingerprints, so orders timed by one are not recalled for the other.
    ``rename`` maps names and string constants first (``choices.canonical``), and local
    variables count by position only: their names, and the order of the factors of a size
    product (sorted by name), are all that renaming a network changes, so that it has the
    same digest."""
    digest = hashlib.sha1()
    local = set(dis.haslocal) | set(dis.hasfree)

    def add(code: Any) -> None:
        for ins in dis.get_instructions(code):
            arg = ins.argval
            if hasattr(arg, "co_code"):
                add(arg)
                continue
            if ins.opcode in local:
                text = ""
            elif isinstance(arg, frozenset):  # its repr's order varies between processes
                text = repr(sorted(map(repr, arg)))
            else:
                text = repr(arg)
            digest.update(f"{ins.opname} {rename(text)}\n".encode())
    for cls in classes:
        add(cls.forward.__code__)
    return digest.hexdigest()[:16]


def source_of(fn: Any) -> str:
    """The generated source a loaded function belongs to (for debugging and tests)."""
    return "".join(linecache.getlines(fn.__code__.co_filename))


#: every layer by the name it is traced under: dynamo takes a constant function's arguments
#: as constants, which a module is not in every torch release (2.11 refuses it)
TRACED: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_names = itertools.count()


def traced_as(layer: Any) -> str:
    """A new name for ``layer`` in :data:`TRACED` (a copy of a layer is another layer)."""
    name = f"layer{next(_names)}"
    TRACED[name] = layer
    return name


def compilable_key(name: str) -> str:
    """Plan and load the ``_compilable_class()`` of the layer traced as ``name``, leave it on
    the layer as ``_traced_class`` and return the name of its generated source. Dynamo calls
    this once per trace and takes the result as a constant, so that tracing (and ``fullgraph``
    compiling before any eager call) needs no planning in the traced code. The class is an
    attribute of the layer, not an entry of a module-level dict: dynamo keeps what it first
    read of a global dict for the whole trace, so the lookup raised KeyError, which broke the
    graph at every layer and compiled each as a frame of its own (layers share that frame's
    code, so past torch's recompile limit of 8 they ran eagerly)."""
    layer = TRACED[name]
    cls = layer._compilable_class()
    layer.__dict__["_traced_class"] = cls
    return cls.forward.__code__.co_filename


# what torch._dynamo.assume_constant_result sets; written here so that ``import tnspec`` does
# not import dynamo (tests/test_integration.py checks that the decorator still sets only this)
compilable_key._dynamo_marked_constant = True  # type: ignore[attr-defined]
