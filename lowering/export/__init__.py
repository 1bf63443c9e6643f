"""Stage 1 — export.

``torch.export.export`` of a module (or ``torch.export.load`` of a ``.pt2``),
then decomposition to the core ATen operator set in the form ExecuTorch's
portable kernels accept (the *edge form*):

- core ATen ops only, decomposed with torch's default table
  (``torch.export.default_decompositions()``, what ``run_decompositions()`` uses);
- functional: no in-place ops; a buffer updated in place is a
  ``BUFFER_MUTATION`` output of the graph signature;
- view ops replaced by their ``*_copy`` variants, so that every tensor owns its
  memory and can be planned;
- runtime asserts removed;
- every node has a ``meta["val"]`` (FakeTensor) that the memory planner and the
  emitter read shapes, dtypes and strides from.

Two ways to get there, same result:

- the **fast path** (:func:`~lowering.export.fast_path.fast_core_aten`) rewrites only the nodes that need it:
  an in-place op on a buffer or on an unaliased intermediate becomes its
  functional variant; each op that the default table (or its
  CompositeImplicitAutograd kernel) decomposes is traced alone with ``make_fx``
  on FakeTensors built from its inputs' ``meta["val"]`` and the small graph is
  spliced in its place.  A retrace of the whole program costs >= 0.15 s even on
  a 5-node graph; tracing one op costs a few milliseconds.
  Symbolic shapes too: a decomposition reads a dynamic size from the node that
  computes it (``sym_size``), and a custom op writing a buffer (``llama::update_cache``)
  becomes ``auto_functionalized_v2`` as functionalization makes it (an hf: decoder,
  Qwen2.5-0.5B: ~30 CPU-s of retrace saved, the same ``.pte``).
- the **slow path**, ``ExportedProgram.run_decompositions()`` (a full retrace
  with functionalization), for whatever the fast path does not handle:
  higher-order ops, get_attr / call_module nodes, mutations
  through views or of user inputs / parameters / constants, ops the fast path
  does not know, a decomposition that itself mutates or makes constants or
  computes a new symbolic value, a view of a tensor written in place when shapes are
  symbolic.

After either path, two cheap clean-ups: parameters, buffers and constants no
node uses are removed, and (``fold_constants=True``) view-copies of parameters
and constants (e.g. a Linear's transposed weight) are folded into new lifted
constants so that they neither run nor occupy the arena at runtime.

The rooms of this package:

- here: the entry points (:func:`export`, :func:`load`, :func:`to_edge`) and
  the switches :data:`FAST_PATH` / :data:`FOLD_CONSTANTS`, which tests and
  benchmarks set on this package (``monkeypatch.setattr(lowering.export,
  "FAST_PATH", False)``), so :func:`to_edge`, which reads them, lives here too;
- :mod:`~lowering.export.fast_path`: the fast path's driver and its checks;
- :mod:`~lowering.export.functionalize`: in-place ops to functional ones;
- :mod:`~lowering.export.decompose`: non-core ops traced alone and spliced in;
- :mod:`~lowering.export.fallback`: :class:`~lowering.export.fallback.Fallback`
  and the slow path;
- :mod:`~lowering.export.cleanups`: views to copies, no asserts, no unused constants;
- :mod:`~lowering.export.folding`: constant folding of weight views;
- :mod:`~lowering.export.kept`: ops a partitioner keeps whole (``ops_to_not_decompose``);
- :mod:`~lowering.export.aliases`: lifted constants that are a buffer under another
  name (state held by a plain Python object too) merged into the buffer;
- :mod:`~lowering.export.control_flow`: the cond / map case (what is supported).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
from typing import Any, Mapping, Sequence

import torch
from torch.export import ExportedProgram

from ..dynamic import DynamicShapeError, check_bounded, complete_dynamic_shapes, sym_scalars_to_tensors
from ..errors import ExportError, UntrustedInputError, first_line
from ..untrusted import load_pt2 as load_untrusted_pt2
from .aliases import buffers_kept, merge_aliased_constants
from .cleanups import (
    cancel_inverse_permutes,
    infer_symbolic_view_size,
    remove_asserts,
    remove_unused_constants,
    replace_view_ops_with_copies,
)
from .control_flow import check_control_flow
from .decompose import decompose_kept, decompose_to_core
from .fallback import Fallback, slow_core_aten
from .fast_path import fast_core_aten
from .folding import fold_constant_views
from .kept import KEPT, KeepQuestion, kept_ops
from .functionalize import functionalize_mutations, remove_buffer_copies, rewrite_tensor_constant_ops

log = logging.getLogger(__name__)

#: Use the fast path (local decomposition) when it applies; else always retrace.
FAST_PATH = True

#: Default of ``fold_constants`` in :func:`export`, :func:`load` and :func:`to_edge`.
FOLD_CONSTANTS = True

#: ``graph_module.meta`` key telling which path produced an edge program:
#: ``"fast"`` or ``"slow: <reason the fast path was not taken>"``.
PATH_META = "lowerflow_stage1"


# ------------------------------------------------------------------ entry points


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    dynamic_shapes: Mapping[str, Any] | Sequence[Any] | None = None,
    name: str | None = None,
    fast: bool | None = None,
    fold_constants: bool | None = None,
    strict: bool = False,
    keep: KeepQuestion | None = None,
) -> ExportedProgram:
    """Export ``model`` on ``example_inputs`` and bring it to the edge form.

    ``dynamic_shapes`` is torch.export's argument; by name, arguments left out
    are static.  Every ``torch.export.Dim`` needs a max (the runtime reserves
    memory for it), or :class:`ExportError` names the input and dim.
    ``name`` is used in error messages (defaults to the model's class name).
    ``fast`` / ``fold_constants`` default to :data:`FAST_PATH` / :data:`FOLD_CONSTANTS`.
    ``strict``: torch.export's strict mode (TorchDynamo traces the Python code); the default,
    non-strict, has lifted constants that alias a buffer merged into it
    (:func:`~lowering.export.aliases.merge_aliased_constants`).
    ``keep``: a partitioner's ``ops_to_not_decompose``; its ops stay whole (:mod:`~lowering.export.kept`).
    """
    label = name or type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise ExportError(
            f"model {label!r}: expected a torch.nn.Module, got {type(model).__name__}"
        )
    if isinstance(example_inputs, torch.Tensor) or not isinstance(
        example_inputs, (tuple, list)
    ):
        raise ExportError(
            f"model {label!r}: example_inputs must be a tuple of inputs, "
            f"got {type(example_inputs).__name__}"
        )
    try:
        dynamic_shapes = complete_dynamic_shapes(model, len(example_inputs), dynamic_shapes)
        with contextlib.nullcontext() if strict else buffers_kept(model):
            exported = torch.export.export(
                model, tuple(example_inputs), dynamic_shapes=dynamic_shapes, strict=bool(strict)
            )
    except Exception as exc:  # torch raises many unrelated types here
        raise ExportError(f"model {label!r}: {_export_failure(model, example_inputs, exc)}") from exc
    if not strict:
        merged = merge_aliased_constants(exported)
        if merged:
            log.debug("model %r: lifted constants %s are buffers under another name: merged", label, merged)
    return to_edge(exported, name=label, fast=fast, fold_constants=fold_constants, keep=keep)


def _export_failure(model: torch.nn.Module, example_inputs: Sequence[Any], exc: Exception) -> str:
    """Why torch.export failed, in one line: if the model fails in eager on its example
    inputs too (a wrong input shape or dtype), say that, with eager's own message
    (clearer than the fake-tensor one); otherwise torch.export's reason."""
    try:
        with torch.no_grad():
            copy.deepcopy(model)(*example_inputs)
    except Exception as eager:
        shapes = ", ".join(
            f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" if isinstance(x, torch.Tensor)
            else type(x).__name__
            for x in example_inputs
        )
        return (
            f"the model fails on its example inputs ({shapes}) in eager mode too: "
            f"{type(eager).__name__}: {first_line(eager)}"
        )
    if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
        return (
            "the model branches on tensor values (data-dependent control flow), which torch.export "
            "cannot trace; use torch.cond or make the branch depend on shapes only "
            f"({type(exc).__name__}: {first_line(exc)})"
        )
    return f"torch.export.export failed: {type(exc).__name__}: {first_line(exc)}"


def load(
    source: str | os.PathLike | bytes | io.IOBase,
    *,
    name: str | None = None,
    fast: bool | None = None,
    fold_constants: bool | None = None,
    trust_pickle: bool = False,
    keep: KeepQuestion | None = None,
) -> ExportedProgram:
    """Load a ``.pt2`` saved by ``torch.export.save`` and bring it to the edge form
    (``keep``: as in :func:`export`).

    Loading runs none of the archive's code: whatever would (a pickled weight or
    constant, compiled code, a symbolic size that is not plain sympy) is an
    :class:`~lowering.errors.UntrustedInputError` naming the entry, raised before anything
    unpickles (:mod:`lowering.untrusted`).  ``trust_pickle``: load with
    ``torch.export.load`` as it is, for a file the user trusts.
    """
    label = name or (str(source) if isinstance(source, (str, os.PathLike)) else "<pt2 bytes>")
    try:
        data = _read_bytes(source)
        exported = load_untrusted_pt2(data, label, trust_pickle=trust_pickle)
    except UntrustedInputError:
        raise
    except Exception as exc:
        raise ExportError(f"model {label!r}: cannot load .pt2: {first_line(exc)}") from exc
    return to_edge(exported, name=label, fast=fast, fold_constants=fold_constants, keep=keep)


def _read_bytes(source: str | os.PathLike | bytes | io.IOBase) -> bytes:
    """The archive's bytes: checked and loaded from one copy (a file cannot change between)."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return f.read()
    return source.read()


def to_edge(
    exported: ExportedProgram,
    *,
    name: str = "<program>",
    fast: bool | None = None,
    fold_constants: bool | None = None,
    keep: KeepQuestion | None = None,
) -> ExportedProgram:
    """Decompose to core ATen, rewrite view ops, drop asserts and unused constants.

    ``exported`` itself is left unchanged.

    Before (training IR from ``torch.export.export``)::

        %linear = aten.linear.default(%x, %p_w, %p_b)
        %v = aten.view.default(%linear, [4, 8])
        %_ = aten._assert_tensor_metadata.default(%x, ...)

    After::

        %permute = aten.permute_copy.default(%p_w, [1, 0])
        %addmm = aten.addmm.default(%p_b, %x, %permute)
        %v = aten.view_copy.default(%addmm, [4, 8])

    With ``fold_constants`` the ``permute_copy`` of the parameter becomes a
    lifted constant (see :func:`fold_constant_views`).  ``keep`` (a partitioner's
    ``ops_to_not_decompose``, asked on ``exported``): the nodes it keeps stay whole,
    marked ``meta[KEPT]`` (:mod:`~lowering.export.kept`).
    """
    kept = kept_ops(keep, exported)
    fast = FAST_PATH if fast is None else fast
    fold_constants = FOLD_CONSTANTS if fold_constants is None else fold_constants
    program, path = None, "slow: fast path disabled"
    if fast:
        try:
            program, path = fast_core_aten(exported, kept), "fast"
        except Fallback as why:
            path = f"slow: {why}"
            log.debug("model %r: stage 1 falls back to run_decompositions(): %s", name, why)
        except Exception as exc:  # a bug of the fast path must not fail the export
            path = f"slow: fast path failed: {type(exc).__name__}: {first_line(exc)}"
            log.warning("model %r: %s", name, path)
    if program is None:
        program = slow_core_aten(exported, name, kept)
        if kept is not None and kept.check is not None:
            decompose_kept(program, kept)
    program = _finish_edge(program, fold_constants=fold_constants, name=name)
    check_control_flow(program, name)
    program.graph_module.meta[PATH_META] = path
    try:
        check_bounded(program)
    except DynamicShapeError as exc:
        raise ExportError(f"model {name!r}: {exc}") from None
    return program



def _finish_edge(program: ExportedProgram, *, fold_constants: bool, name: str) -> ExportedProgram:
    """Fold constant views (optional), drop unused lifted inputs, recompile if changed."""
    graph = program.graph_module.graph
    changed = sym_scalars_to_tensors(graph)
    changed += infer_symbolic_view_size(graph)
    changed += cancel_inverse_permutes(graph)
    if fold_constants:
        try:
            changed += fold_constant_views(program)
        except Exception as exc:
            raise ExportError(f"model {name!r}: constant folding failed: {first_line(exc)}") from exc
    changed += remove_unused_constants(program)
    if changed:  # a recompile costs ~25 ms on the LSTM's 700 nodes
        graph.lint()
        program.graph_module.recompile()
    return program


__all__ = [
    "FAST_PATH",
    "FOLD_CONSTANTS",
    "KEPT",
    "cancel_inverse_permutes",
    "PATH_META",
    "decompose_to_core",
    "export",
    "fast_core_aten",
    "fold_constant_views",
    "functionalize_mutations",
    "load",
    "merge_aliased_constants",
    "remove_asserts",
    "remove_buffer_copies",
    "remove_unused_constants",
    "replace_view_ops_with_copies",
    "rewrite_tensor_constant_ops",
    "to_edge",
]
