"""The stock ExecuTorch runtime's operators, as committed data, and the runtime profiles.

``stock_ops.json`` (beside this file; ``tests/tools/stock_ops.py`` regenerates it from
an installed ``executorch``, and ``tests/test_stock_ops.py`` fails when it is stale)
holds the operator names the pip runtime registers, in three sets::

    portable   240  aten::add.out, aten::sym_size.int, executorch_prim::add.Scalar, ...
                    (portable kernels and prim ops: always there)
    quantized   19  quantized_decomposed::*.out   (import executorch.kernels.quantized)
    llm         11  llama::custom_sdpa.out, ...   (import executorch.extension.llm.custom_ops.custom_ops)

A *runtime profile* is the sets a program may call: by default every stock set plus
``"fused"`` (a backend's fused op no backend took, :mod:`lowering.backend_ops`, which
lowerflow's executor runs and a runtime with the backend's kernels linked in);
``runtime_ops=("portable",)`` is the bare stock runtime.

Stage 1 decomposes an ATen op whose out variant has no portable kernel when torch has
a decomposition of it (:func:`stock_decomposition`), as ExecuTorch does for
``aten.linalg_vector_norm``::

    before:  %n = aten.linalg_vector_norm.default(%v, 2, [1, 2], True)     (no kernel)
    after:   %pow_1 = aten.pow.Tensor_Scalar(%v, 2)
             %sum_1 = aten.sum.dim_IntList(%pow_1, [1, 2], True)
             %n = aten.pow.Tensor_Scalar(%sum_1, 0.5)
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..errors import LoweringError
from ..memory_plan.out_variants import out_variant_name

#: The committed table.
TABLE_PATH = Path(__file__).with_name("stock_ops.json")
#: The stock runtime's op sets; "portable" is always loaded, the others are libraries.
STOCK_SETS = ("portable", "quantized", "llm")
OPTIONAL_SETS = ("quantized", "llm")
#: Each optional set: the module of the ``executorch`` package whose import loads its
#: kernel library into the runtime (names only: lowerflow never imports them itself).
LIBRARIES = {
    "quantized": "executorch.kernels.quantized",
    "llm": "executorch.extension.llm.custom_ops.custom_ops",
}
#: The profile entry for backend fused ops (not a stock set).
FUSED = "fused"
#: What a program may call unless ``runtime_ops`` says otherwise.
DEFAULT_PROFILE = (*STOCK_SETS, FUSED)


@dataclass(frozen=True)
class StockTable:
    """The committed table: the ExecuTorch version it was read from and the sets."""

    executorch: str
    sets: dict[str, frozenset[str]]

    @property
    def namespaces(self) -> frozenset[str]:
        """The operator namespaces of every stock set (``aten``, ``llama``, ...)."""
        return frozenset(op.partition("::")[0] for ops in self.sets.values() for op in ops)

    def set_of(self, operator: str) -> str | None:
        """The stock set holding ``operator`` (``"ns::name.overload"``), or None."""
        return next((name for name in STOCK_SETS if operator in self.sets[name]), None)


@functools.cache
def stock_table() -> StockTable:
    """The table in ``stock_ops.json`` (read once per process)."""
    data = json.loads(TABLE_PATH.read_text(encoding="utf-8"))
    return StockTable(data["executorch"], {name: frozenset(data["sets"][name]) for name in STOCK_SETS})


def needed_sets(operator_names: Iterable[str]) -> set[str]:
    """The optional sets (``"quantized"``, ``"llm"``) whose libraries these operators need."""
    table = stock_table()
    return {s for s in map(table.set_of, operator_names) if s in OPTIONAL_SETS}


def runtime_profile(runtime_ops: Iterable[str] | str | None = None) -> tuple[str, ...]:
    """The profile ``runtime_ops`` names, in canonical order; "portable" is always in it.

    ``None`` is :data:`DEFAULT_PROFILE`; an unknown name is a :class:`LoweringError`.
    """
    if runtime_ops is None:
        return DEFAULT_PROFILE
    names = [runtime_ops] if isinstance(runtime_ops, str) else list(runtime_ops)
    known = (*STOCK_SETS, FUSED)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise LoweringError(f"runtime_ops: unknown op set {unknown[0]!r}; expected some of {list(known)}")
    return tuple(n for n in known if n == "portable" or n in names)


def has_portable_kernel(op: torch._ops.OpOverload) -> bool | None:
    """Whether the stock runtime's portable set has ``op``'s out variant (None: no out variant)."""
    out = out_variant_name(op)
    return None if out is None else out in stock_table().sets["portable"]


@functools.cache
def stock_decomposition(op: Any) -> Callable | None:
    """torch's decomposition of an ATen op whose out variant the portable set lacks; else None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    from torch._decomp import decomposition_table

    decomposition = decomposition_table.get(op)
    if decomposition is None or has_portable_kernel(op) is not False:
        return None
    return decomposition


@functools.cache
def stock_decompositions() -> dict:
    """Every :func:`stock_decomposition` torch has (~500 ops; 0.1 s, once per process):
    a decomposition table for a trace whose ops are not known in advance."""
    from torch._decomp import decomposition_table

    table = {}
    for op in list(decomposition_table):
        decomposition = stock_decomposition(op)
        if decomposition is not None:
            table[op] = decomposition
    return table
