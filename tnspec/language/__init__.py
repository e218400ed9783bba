"""Stage 1, the language: spec text -> a checked :class:`tnspec.ir.Network`.

``nodes`` (the parse tree as frozen dataclasses), ``parse`` (Lark grammar -> nodes, syntax errors
with a caret), ``settings`` (sizes and options of a layer), ``conv_edges`` (an affine index such
as ``2*h+kh-1`` read as a conv relation) and ``check`` (every semantic error at once, then the IR).
"""
