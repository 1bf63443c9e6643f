"""The quantize stage: an edge-form program to a quantized edge-form program.

    export ─► quantize ─► to_backend ─► memory plan ─► emit

Rooms:

- :mod:`~lowering.quantize.recipes`: what to do (:class:`QuantRecipe`, :func:`parse_recipe`);
- :mod:`~lowering.quantize.stage`: :func:`quantize`, the entry point;
- :mod:`~lowering.quantize.calibration`: calibration batches, checked;
- :mod:`~lowering.quantize.graph`: graph edits the passes share (lift constants, unfold weights);
- :mod:`~lowering.quantize.dynamic`: ``int8-dynamic`` / ``8da4w`` (graph rewrite: torchao's affine ops for
  linears, ``quantized_decomposed`` ops for int8-dynamic's convolutions);
- :mod:`~lowering.quantize.bn_fold`: BatchNorm after a convolution folded into it;
- :mod:`~lowering.quantize.quantizer`: lowerflow's PT2E quantizer for XNNPACK (annotation rules);
- :mod:`~lowering.quantize.static`: ``int8`` (prepare_pt2e, calibrate, convert_pt2e, re-export).
"""

from ..errors import QuantizeError
from ..quant_ops import register_quantized_ops
from .recipes import RECIPE_NAMES, QuantRecipe, parse_recipe
from .stage import quantize, quantize_module

__all__ = ["QuantRecipe", "QuantizeError", "RECIPE_NAMES", "parse_recipe", "quantize", "quantize_module"]

# A quantized program's q/dq ops exist in torch.ops once this package is imported.
register_quantized_ops("quantized_decomposed.")
