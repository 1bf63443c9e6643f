"""Stage 7, out variants: the ``.out`` overload the portable kernels implement for each op.

Every ATen call of the program becomes, at emission, a KernelCall of its out
variant (``aten::add`` + overload ``out``) writing into planned memory; the
plan records the choice (``plan.out_variants["addmm"] == "aten::addmm.out"``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import torch
from torch._higher_order_ops.executorch_call_delegate import executorch_call_delegate

from ..control_flow_graph import is_control_flow
from ..dynamic import is_sym_op
from ..errors import MemoryPlanError
from ..mutating_ops import is_auto_functionalized, out_variant as mutating_out_variant
from ..quant_ops import EMBEDDING_NAMESPACE, out_variant_of


def find_out_variants(graph: torch.fx.Graph) -> dict[str, str]:
    """Map each ``call_function`` OpOverload node to its out overload name.

    ``getitem`` and the delegate call are skipped; an op without an out
    variant raises :class:`MemoryPlanError` naming the op and the node.
    """
    out: dict[str, str] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or _is_delegate_call(node):
            continue
        if is_sym_op(node.target) or is_control_flow(node):
            # a symbolic int op is a prim op of the runtime (no memory); a cond / map's
            # submodules' ops are planned with their own keys
            continue
        if is_auto_functionalized(node):  # a mutating custom op: its .out writes the base in place
            name = mutating_out_variant(node)
            if name is None:
                raise MemoryPlanError(f"op {node.args[0]} at node {node.name!r} mutates its input and "
                                      "has no '.out' overload")
            out[node.name] = name
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            if _tensor_vals(node):
                raise MemoryPlanError(
                    f"node {node.name!r}: {node.target} is not an ATen operator overload "
                    "and produces tensors; it cannot be memory-planned"
                )
            continue
        name = out_variant_name(node.target)
        if name is None:
            raise MemoryPlanError(
                f"op {node.target} at node {node.name!r} has no out variant "
                "(no '.out' overload with a matching schema is registered)"
            )
        out[node.name] = name
    return out


def out_variant_name(op: torch._ops.OpOverload) -> str | None:
    """``aten.add.Tensor`` -> ``"aten::add.out"``; None if no out overload matches."""
    schema = op._schema
    if schema.name.startswith(("quantized_decomposed::", f"{EMBEDDING_NAMESPACE}::")):
        return out_variant_of(op)  # the stock runtime's quantized kernels
    return _out_variant_table(schema.name).get(schema.overload_name or "default")


@functools.lru_cache(maxsize=None)
def _out_variant_table(qualified_name: str) -> dict[str, str]:
    """overload name -> out overload name, for every schema of one operator.

    Schemas are grouped by their torchgen signature (arguments without the
    out arguments, no returns), which is how a functional schema and its out
    variant are paired; an out schema maps to itself.
    """
    from torchgen.model import FunctionSchema, SchemaKind

    parsed = []
    for pybind_schema in torch._C._jit_get_schemas_for_operator(qualified_name):
        try:
            parsed.append(FunctionSchema.parse(str(pybind_schema)))
        except Exception:  # torchgen cannot parse some prim schemas; they have no out form
            continue
    groups: dict[Any, dict[Any, Any]] = {}
    for schema in parsed:
        signature = dataclasses.replace(schema.signature(), returns=())
        groups.setdefault(signature, {})[schema.kind()] = schema
    table: dict[str, str] = {}
    for group in groups.values():
        out_schema = group.get(SchemaKind.out)
        if out_schema is None:
            continue
        out_name = _qualified_overload(qualified_name, out_schema.name.overload_name)
        for kind in (SchemaKind.functional, SchemaKind.out):
            schema = group.get(kind)
            if schema is not None:
                table[schema.name.overload_name or "default"] = out_name
    return table


def _qualified_overload(qualified_name: str, overload: str) -> str:
    return f"{qualified_name}.{overload}" if overload else qualified_name


def _is_delegate_call(node: torch.fx.Node) -> bool:
    """A call of a delegated payload: its outputs are planned, but it has no
    out variant (the backend writes them)."""
    return node.op == "call_function" and node.target is executorch_call_delegate


def _tensor_vals(node: torch.fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []
