"""Stage 8, constant methods: a method with no inputs that returns a constant.

ExecuTorch's ``constant_methods`` (its emitter's ``_emit_prim_getters``): the
metadata an LLM runner reads (``get_max_seq_len``, ``use_kv_cache``,
``get_eos_ids``, ...) is a method of the program whose plan holds the value
and returns it, with no instructions and no planned memory::

    {"get_max_seq_len": 128}    ─►  plan get_max_seq_len: values [Int 128],
                                    inputs [], outputs [0], one empty chain,
                                    non_const_buffer_sizes [0]
    {"get_eos_ids": [2, 7]}     ─►  values [Int 2, Int 7], outputs [0, 1]
                                    (a list is flattened, its pytree spec in
                                    the plan's container metadata)

A bool is a Bool, an int an Int, a float a Double, a str a String.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import tree_flatten, treespec_dumps

from ..errors import EmitError
from ..pte import schema
from .evalues import scalar_evalue, string_evalue

#: The Python types a constant method may return (and lists / tuples of them).
CONSTANT_TYPES = (bool, int, float, str)


def is_constant_value(value: Any) -> bool:
    """Whether ``value`` can be a constant method's value."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, CONSTANT_TYPES) for v in value)
    return isinstance(value, CONSTANT_TYPES)


def constant_plan(name: str, value: Any) -> schema.ExecutionPlanT:
    """The execution plan of method ``name`` returning ``value``."""
    if not is_constant_value(value):
        raise EmitError(f"constant method {name!r}: a {type(value).__name__} is not a constant "
                        f"(expected bool, int, float, str or a list of them)")
    leaves, spec = tree_flatten(list(value) if isinstance(value, tuple) else value)
    values = [string_evalue(v) if isinstance(v, str) else scalar_evalue(v) for v in leaves]
    chain = schema.ChainT()
    chain.inputs, chain.outputs, chain.instructions = [], [], []
    meta = schema.ContainerMetadataT()
    meta.encodedInpStr, meta.encodedOutStr = "", treespec_dumps(spec)
    plan = schema.ExecutionPlanT()
    plan.name = name
    plan.containerMetaType = meta
    plan.values = values
    plan.inputs = []
    plan.outputs = list(range(len(values)))
    plan.chains = [chain]
    plan.operators = []
    plan.delegates = []
    plan.nonConstBufferSizes = [0]
    return plan
