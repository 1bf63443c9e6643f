"""The quantize stage: an edge-form program to a quantized edge-form program.

    export ─► quantize ─► to_backend ─► memory plan ─► emit

Rooms: :mod:`~lowering.quantize.recipes` (what to do: :class:`QuantRecipe`,
:func:`parse_recipe`).
"""

from ..errors import QuantizeError
from .recipes import RECIPE_NAMES, QuantRecipe, parse_recipe

__all__ = ["QuantRecipe", "QuantizeError", "RECIPE_NAMES", "parse_recipe"]
