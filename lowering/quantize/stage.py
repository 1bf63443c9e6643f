"""``quantize``: the stage's entry point (recipe, calibration, copy, dispatch).

    edge program ─► quantize(program, recipe, calibration) ─► quantized edge program

``int8`` runs :mod:`~lowering.quantize.static` (PT2E with lowerflow's own
quantizer, then a re-export); ``int8-dynamic`` and ``8da4w`` run
:mod:`~lowering.quantize.dynamic` (a graph rewrite).  The input program is not
modified.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.export import ExportedProgram

from ..errors import QuantizeError
from .calibration import calibration_batches
from .graph import copy_program, unmatched_keep_fp32
from .recipes import parse_recipe

log = logging.getLogger(__name__)

#: ``graph_module.meta`` key listing the linears a recipe left fp32 and why.
SKIPPED_META = "lowerflow_quantize_skipped"


def quantize(program: ExportedProgram, recipe: Any, calibration: Any = None, *, name: str | None = None) -> ExportedProgram:
    """The quantized edge-form program of ``program`` (see :mod:`lowering.quantize`).

    ``recipe``: anything :func:`~lowering.quantize.parse_recipe` takes.
    ``calibration``: an iterable of input tuples, or a callable returning one;
    required by ``int8``, ignored (but still checked) by the dynamic recipes.
    ``name`` is used in error messages.
    """
    recipe = parse_recipe(recipe)
    label = f"model {name!r}" if name else "program"
    if not isinstance(program, ExportedProgram):
        raise QuantizeError(f"{label}: quantize expects an ExportedProgram, got {type(program).__name__}")
    _warn_unmatched(program, recipe, label)
    batches = calibration_batches(program, calibration, label)
    if recipe.needs_calibration and not batches:
        raise QuantizeError(
            f"{label}: recipe {recipe.name!r} (static int8) needs calibration data: pass calibration= "
            "an iterable of input tuples (a few representative batches), or use 'int8-dynamic'"
        )
    if recipe.needs_calibration:
        from .static import quantize_static

        return quantize_static(program, recipe, batches, label)
    from .dynamic import quantize_dynamic

    quantized, skipped, in_mha = quantize_dynamic(copy_program(program), recipe)
    if skipped:
        log.info("%s: %s left %d linear(s) fp32 (K not a multiple of %d): %s", label, recipe.name,
                 len(skipped), recipe.group_size, ", ".join(skipped))
    if in_mha:
        log.info("%s: %s left %d linear(s) of nn.MultiheadAttention fp32, as torchao's nn.Linear filter "
                 "does (quantize_mha: true quantizes them): %s", label, recipe.name, len(in_mha), ", ".join(in_mha))
    quantized.graph_module.meta[SKIPPED_META] = tuple(skipped + in_mha)
    return quantized


def quantize_module(model: Any, example_inputs: Any, recipe: Any, calibration: Any, quantizer: Any, *,
                    name: str | None = None, keep: Any = None) -> ExportedProgram:
    """``int8`` with a backend's own PT2E ``quantizer`` (:meth:`lowering.partition.Partitioner.quantizer`:
    Ethos-U's is Arm's ``EthosUQuantizer``) on ``model`` before decomposition, as ExecuTorch's flow for
    that backend quantizes; then the edge form, the partitioner's kept ops (``keep``) whole.

        module ─► torch.export ─► prepare_pt2e(quantizer) ─► calibration ─► convert_pt2e ─► edge program
    """
    import torch

    from .static import quantize_with

    recipe = parse_recipe(recipe)
    label = f"model {name!r}" if name else "program"
    if recipe.name != "int8" or recipe.keep_fp32:
        raise QuantizeError(f"{label}: the backend's own quantizer does recipe 'int8' without keep_fp32, "
                            f"not {recipe.to_dict()}")
    try:
        exported = torch.export.export(model, tuple(example_inputs))
    except Exception as exc:
        raise QuantizeError(f"{label}: torch.export failed before quantizing: {type(exc).__name__}: {exc}") from exc
    batches = calibration_batches(exported, calibration, label)
    if not batches:
        raise QuantizeError(f"{label}: recipe 'int8' (static int8) needs calibration data: pass calibration= "
                            "an iterable of input tuples")
    # (no guard submodule: the backend quantizers' passes reject call_module nodes)
    return quantize_with(exported.module(check_guards=False), quantizer, batches, label, keep)


def _warn_unmatched(program: ExportedProgram, recipe, label: str) -> None:
    unmatched = unmatched_keep_fp32(program.graph, recipe.keep_fp32)
    if unmatched:
        log.warning("%s: keep_fp32 entries %s name no module of the program (fqn prefix or class name)",
                    label, unmatched)
