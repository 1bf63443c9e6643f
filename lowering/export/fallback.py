"""Stage 1's fallback: when the fast path gives up, and the slow path it falls back to.

The fast path (:mod:`lowering.export.fast_path`) raises :class:`Fallback`, with
the reason, for whatever it does not handle: higher-order ops,
get_attr / call_module nodes, mutations through views or of user
inputs / parameters / constants, ops it does not know, a decomposition that
itself mutates or makes constants.  The slow path, :func:`slow_core_aten`, is
``ExportedProgram.run_decompositions()`` (a full retrace with
functionalization, >= 0.15 s even on a 5-node graph; a second one when the result
still calls an op the stock runtime lacks and torch decomposes), followed by the same
clean-ups, inside cond / map submodules too
(:func:`lowering.export.control_flow.clean_control_flow_submodules`).
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from ..control_flow_graph import iter_scopes
from ..errors import ExportError, first_line
from ..stock_ops.table import stock_decomposition, stock_decompositions
from .cleanups import remove_asserts, replace_view_ops_with_copies
from .control_flow import clean_control_flow_submodules
from .kept import KeptOps, mark_kept


#: What the decomposition failure's message suggests (one line).
WHAT_TO_TRY = (
    "what to try: export with strict=True (`lowerflow lower --strict`, `strict: true` on the manifest "
    "entry, lowering.export(..., strict=True)); keep module state in registered buffers of nn.Modules, "
    "not in plain Python objects; or export the model yourself and give lowerflow the .pt2"
)


class Fallback(Exception):
    """The fast path does not handle this program; the message says why."""


def slow_core_aten(exported: ExportedProgram, name: str, kept: KeptOps | None = None) -> ExportedProgram:
    """``run_decompositions()`` (a full retrace), then views to copies and no asserts.
    The ops of ``kept`` stay whole (all their nodes, marked ``meta[KEPT]``: the slow path
    cannot ask ``kept.check`` per node; :func:`lowering.export.to_edge` does after)."""
    try:
        decomposed = exported.run_decompositions(without(torch.export.default_decompositions(), kept))
        table = stock_decomposition_table(decomposed)
        if table is not None:  # ops the stock runtime lacks: once more, decomposing them too
            decomposed = exported.run_decompositions(without(table, kept))
    except Exception as exc:
        raise ExportError(
            f"model {name!r}: decomposition to core ATen failed: {first_line(exc)}; {WHAT_TO_TRY}"
        ) from exc
    graph = decomposed.graph_module.graph
    replace_view_ops_with_copies(graph)
    remove_asserts(graph)
    clean_control_flow_submodules(decomposed)
    if kept is not None:
        mark_kept(graph, kept)
    graph.lint()
    decomposed.graph_module.recompile()
    return decomposed


def without(table, kept: KeptOps | None):
    """``table`` (a decomposition table) without the ops ``kept`` keeps."""
    for op in kept.ops if kept is not None else ():
        if op in table:
            del table[op]
    return table


def stock_decomposition_table(program: ExportedProgram) -> dict | None:
    """The slow path's table when ``program`` (after ``run_decompositions()``) still calls
    an op the stock runtime lacks and torch decomposes: the default table plus the
    stock decompositions; None when it calls none (the usual case)."""
    for _, gm in iter_scopes(program.graph_module):
        if any(n.op == "call_function" and stock_decomposition(n.target) for n in gm.graph.nodes):
            table = torch.export.default_decompositions()
            for op, decomposition in stock_decompositions().items():
                if op not in table:
                    table[op] = decomposition
            return table
    return None
