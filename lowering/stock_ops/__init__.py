"""Only ops the stock runtime has: the table of the stock ExecuTorch runtime's operators,
runtime profiles, and the check emit runs before it writes bytes.

- :mod:`~lowering.stock_ops.table`: the committed table (``stock_ops.json``: sets
  "portable", "quantized", "llm", with the ExecuTorch version it came from), profiles
  (``runtime_ops``), :func:`needed_sets`, and the decompositions stage 1 applies to ATen
  ops the portable set lacks;
- :mod:`~lowering.stock_ops.check`: :func:`check_program_ops`.

``tests/tools/stock_ops.py`` regenerates the table from an installed ``executorch``;
nothing here imports it.
"""

from .check import check_program_ops
from .table import (
    DEFAULT_PROFILE,
    FUSED,
    LIBRARIES,
    OPTIONAL_SETS,
    STOCK_SETS,
    StockTable,
    has_portable_kernel,
    needed_sets,
    runtime_profile,
    stock_decomposition,
    stock_decompositions,
    stock_table,
)

__all__ = [
    "DEFAULT_PROFILE",
    "FUSED",
    "LIBRARIES",
    "OPTIONAL_SETS",
    "STOCK_SETS",
    "StockTable",
    "check_program_ops",
    "has_portable_kernel",
    "needed_sets",
    "runtime_profile",
    "stock_decomposition",
    "stock_decompositions",
    "stock_table",
]
