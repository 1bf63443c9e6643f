"""Test helpers for the lowering stages: tagging partitioners and a payload-driven runner."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from lowering import DelegationSpec, Partitioner, PartitionResult, tag_constant_data, tag_mutated_buffer
from lowering.backends.reference import BACKEND_ID, ReferenceRuntime
from lowering.delegate import executorch_call_delegate


class TagBy(Partitioner):
    """Tags each node with ``rule(node)`` (a tag or None) for the reference backend."""

    def __init__(self, rule, *, constants: bool = True, duplicate: bool = True, backend_id: str = BACKEND_ID):
        self.rule = rule
        self.constants = constants
        self.duplicate = duplicate
        self.backend_id = backend_id

    def partition(self, exported_program):
        tags = {}
        for node in exported_program.graph.nodes:
            tag = self.rule(node)
            if tag is not None:
                node.meta["delegation_tag"] = tag
                tags[tag] = DelegationSpec(self.backend_id)
        if self.constants:
            tag_constant_data(exported_program, duplicate_shared=self.duplicate)
            tag_mutated_buffer(exported_program)
        return PartitionResult(exported_program, tags)


def op_is(*names):
    """A rule tagging call_function nodes whose op name (e.g. 'add') is in ``names`` with tag 'T'."""

    def rule(node):
        if node.op == "call_function" and getattr(node.target, "_opname", None) in names:
            return "T"
        return None

    return rule


def run_with_payloads(program):
    """A callable running a delegated program with every delegate executed from its bytes.

    The top level runs in torch.fx's interpreter over ``program.module()``; each
    ``executorch_call_delegate`` goes to the reference runtime, never to the
    lowered module's original program.  Buffer state persists across calls.
    """
    module = program.module()
    runtime = ReferenceRuntime()
    handles = {}

    class PayloadInterpreter(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is executorch_call_delegate:
                lowered, *rest = args
                if id(lowered) not in handles:
                    handles[id(lowered)] = runtime.init(lowered.processed_bytes, lowered.compile_specs)
                return tuple(runtime.execute(handles[id(lowered)], rest))
            return super().call_function(target, args, kwargs)

    # The interpreter flattens the inputs and unflattens the outputs with the
    # module's pytree specs itself.
    return PayloadInterpreter(module).run


def assert_close_tree(actual, expected, atol=1e-5, rtol=1e-4):
    a, sa = pytree.tree_flatten(actual)
    e, se = pytree.tree_flatten(expected)
    assert sa == se, f"structure differs: {sa} vs {se}"
    for x, y in zip(a, e):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def executions_during(fn, *args, **kwargs):
    """``(fn(...), the stages it executed)`` (a Counter of tasks.stages.EXECUTIONS); live
    objects are dropped afterwards, so the next run reads what the store has."""
    from tasks import stages

    before = stages.EXECUTIONS.copy()
    try:
        result = fn(*args, **kwargs)
    finally:
        stages.LIVE.clear()
    return result, stages.EXECUTIONS - before
