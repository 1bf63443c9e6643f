"""``int8``: static quantization with torchao's PT2E flow and lowerflow's quantizer.

    edge program ─► unfold linear weights, fold BatchNorm ─► program.module()
      ─► prepare_pt2e(LowerflowXnnpackQuantizer) ─► calibration batches
      ─► convert_pt2e ─► torch.export.export (first batch) ─► lowering.export.to_edge

Before (edge form)::

    %c__folded_permute = placeholder                       # [K, N]
    %addmm = aten.addmm.default(%p_fc_bias, %x, %c__folded_permute)

After::

    %b__frozen_param0 = placeholder                        # int8 [N, K]
    %b__scale_0 = placeholder;  %b__zero_point_0 = placeholder
    %q = quantized_decomposed.quantize_per_tensor.default(%x, 0.02, -3, -128, 127, torch.int8)
    %dq = quantized_decomposed.dequantize_per_tensor.default(%q, 0.02, -3, -128, 127, torch.int8)
    %w = quantized_decomposed.dequantize_per_channel.default(%b__frozen_param0, %b__scale_0,
                                                             %b__zero_point_0, 0, -127, 127, torch.int8)
    %permute = aten.permute_copy.default(%w, [1, 0])
    %addmm = aten.addmm.default(%p_fc_bias, %dq, %permute)
    %q_1 = quantize_per_tensor.default(%addmm, ...);  %dq_1 = dequantize_per_tensor.default(%q_1, ...)

The re-export specializes shapes to the first calibration batch: a program with
dynamic shapes is refused (QuantizeError).
"""

from __future__ import annotations

import contextlib
import io

import torch
from torch.export import ExportedProgram

from ..errors import QuantizeError, first_line
from .bn_fold import fold_batch_norms
from .graph import copy_program, unfold_linear_weights
from .quantizer import make_quantizer
from .recipes import QuantRecipe


def quantize_static(program: ExportedProgram, recipe: QuantRecipe, batches: list[tuple], label: str) -> ExportedProgram:
    """The int8 program of ``program`` calibrated on ``batches`` (see the module docstring)."""
    _refuse_dynamic_shapes(program, label)
    program = copy_program(program)
    unfold_linear_weights(program)
    fold_batch_norms(program)
    program.graph.lint()
    program.graph_module.recompile()
    converted = _calibrate_and_convert(program.module(), make_quantizer(recipe.keep_fp32), batches, label)
    return _re_export(converted, batches[0], label)


def quantize_with(module: torch.nn.Module, quantizer, batches: list[tuple], label: str, keep=None) -> ExportedProgram:
    """Static int8 of ``module`` (not yet decomposed: ``torch.export.export(...).module()``) with a
    backend's own PT2E ``quantizer``, calibrated on ``batches``, re-exported to the edge form
    (``keep``: the partitioner's ``ops_to_not_decompose``)."""
    return _re_export(_calibrate_and_convert(module, quantizer, batches, label), batches[0], label, keep)


def _refuse_dynamic_shapes(program: ExportedProgram, label: str) -> None:
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and any(
            not isinstance(s, int) for s in val.shape
        ):
            raise QuantizeError(
                f"{label}: recipe 'int8' needs static shapes (input {node.name!r} has a dynamic size "
                f"{tuple(val.shape)}): the calibrated graph is re-exported at the calibration shapes. "
                "Export without dynamic_shapes, or use 'int8-dynamic' / '8da4w'"
            )


def _calibrate_and_convert(module: torch.nn.Module, quantizer, batches: list[tuple], label: str):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    try:
        prepared = prepare_pt2e(module, quantizer)
    except Exception as exc:
        raise QuantizeError(f"{label}: prepare_pt2e failed: {type(exc).__name__}: {first_line(exc)}") from exc
    with torch.no_grad():
        for index, batch in enumerate(batches):
            try:
                prepared(*batch)
            except Exception as exc:
                raise QuantizeError(
                    f"{label}: calibration batch {index} fails in the program: {type(exc).__name__}: {first_line(exc)}"
                ) from exc
    with contextlib.redirect_stdout(io.StringIO()):  # convert_pt2e prints nothing useful
        try:
            return convert_pt2e(prepared)
        except Exception as exc:
            raise QuantizeError(f"{label}: convert_pt2e failed: {type(exc).__name__}: {first_line(exc)}") from exc


def _re_export(converted: torch.fx.GraphModule, example: tuple, label: str, keep=None) -> ExportedProgram:
    from ..export import to_edge

    try:
        exported = torch.export.export(converted, tuple(example), strict=False)
    except Exception as exc:
        raise QuantizeError(
            f"{label}: re-exporting the int8 program failed: {type(exc).__name__}: {first_line(exc)}"
        ) from exc
    return to_edge(exported, name=label, keep=keep)
