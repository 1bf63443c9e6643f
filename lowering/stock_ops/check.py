"""The check before emit writes bytes: every KernelCall's operator is in the runtime profile.

The emitter records, per operator of a method, the first node that calls it
(``{"aten::linalg_vector_norm.out": "linalg_vector_norm"}``);
:func:`check_program_ops` raises :class:`~lowering.errors.MissingOperatorError`, one line
naming the operator and the node, for the first one the profile
(:func:`~lowering.stock_ops.table.runtime_profile`) lacks::

    operator aten::foo.out (node 'foo') has no kernel in the stock ExecuTorch runtime
    (runtime_ops: portable, quantized, llm, fused) and torch has no decomposition of it
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ..errors import MissingOperatorError
from .table import FUSED, runtime_profile, stock_table


def check_program_ops(operators: Mapping[str, str] | Iterable[str], runtime_ops: Iterable[str] | None = None) -> None:
    """Raise :class:`MissingOperatorError` for the first operator ``runtime_ops`` lacks.

    ``operators``: ``{operator name: node name}`` (what the emitter records) or just
    operator names (``"ns::name.overload"``, as :func:`lowering.verify.program_operators`
    lists them).  ``runtime_ops``: a profile (None: the default, every stock set and
    backend fused ops).
    """
    profile = runtime_profile(runtime_ops)
    nodes = operators if isinstance(operators, Mapping) else {op: None for op in operators}
    for operator, node in nodes.items():
        problem = _missing(operator, profile)
        if problem is not None:
            where = f"operator {operator}" + (f" (node {node!r})" if node else "")
            raise MissingOperatorError(f"{where} {problem} (runtime_ops: {', '.join(profile)})")


def _missing(operator: str, profile: tuple[str, ...]) -> str | None:
    """Why ``operator`` cannot run under ``profile``; None when it can."""
    from ..backend_ops import is_fused_op

    op_set = stock_table().set_of(operator)
    if op_set in profile:
        return None
    if op_set is not None:
        return f"needs the stock runtime's {op_set!r} kernels, which the profile leaves out"
    if is_fused_op(operator):
        if FUSED in profile:
            return None
        return "is a backend fused op no backend took; the stock runtime has no kernel for it"
    return "has no kernel in the stock ExecuTorch runtime and torch has no decomposition of it"
