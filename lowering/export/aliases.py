"""Stage 1, before decomposition: lifted constants that are a buffer under another name.

A module may hold its state twice: as a registered buffer *and* in a plain
Python object (transformers' ``StaticCache`` layers keep ``keys``, ``values`` and
``cumulative_length``; the exportable wrapper registers the same tensors as
buffers ``key_cache_0``, ...).  Non-strict ``torch.export`` fakifies module
buffers by rebinding module attributes, so the trace meets the real tensors
inside the plain object and lifts them a second time, as constants.  The
mutations land on the constants, and ``run_decompositions`` then fails inside
AOT autograd (``expected compiled_fn to be GraphModule``: two graph inputs are
one tensor).  Strict export (Dynamo) tracks tensor identity and has no such
duplicate.

:func:`merge_aliased_constants` repairs the program: a lifted constant that is
the very tensor a buffer is (same storage, offset, shape, stride, dtype) is
replaced by that buffer's placeholder::

    before   b_key_cache_0: BUFFER 'key_cache_0'     c_lifted_tensor_2: CONSTANT 'lifted_tensor_2'
             index_copy_(c_lifted_tensor_2, 2, pos, k)      # same storage as key_cache_0
    after    b_key_cache_0: BUFFER 'key_cache_0'
             index_copy_(b_key_cache_0, 2, pos, k)          # a BUFFER_MUTATION once functionalized

The trace itself ran those mutations on the real tensors (they were constants to
it): :func:`buffers_kept` puts every buffer's value back after the export (and
makes it a leaf again: updated from weights that require grad, it would have a
``grad_fn`` and could no longer be deep-copied), so exporting leaves the model as it was.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind


def _identity(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def merge_aliased_constants(program: ExportedProgram) -> list[str]:
    """Replace lifted constants that alias a buffer by the buffer; returns the merged
    constants' names (empty: the program is unchanged)."""
    signature = program.graph_signature
    buffers: dict[tuple, str] = {}
    for spec in signature.input_specs:
        if spec.kind == InputKind.BUFFER:
            tensor = program.state_dict.get(spec.target, program.constants.get(spec.target))
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                buffers.setdefault(_identity(tensor), spec.arg.name)
    if not buffers:
        return []
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    kept, merged = [], []
    for spec in signature.input_specs:
        constant = program.constants.get(spec.target) if spec.kind == InputKind.CONSTANT_TENSOR else None
        buffer = buffers.get(_identity(constant)) if isinstance(constant, torch.Tensor) else None
        if buffer is None or spec.arg.name not in placeholders:
            kept.append(spec)
            continue
        node = placeholders[spec.arg.name]
        node.replace_all_uses_with(placeholders[buffer])
        program.graph.erase_node(node)
        del program.constants[spec.target]
        merged.append(spec.target)
    if merged:
        signature.input_specs[:] = kept
        program.graph_module.recompile()
    return merged


@contextlib.contextmanager
def buffers_kept(model: torch.nn.Module) -> Iterator[None]:
    """Every buffer of ``model`` has its value from before the block after it (a leaf tensor)."""
    saved = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                if buffer.grad_fn is not None:
                    buffer.detach_()
                if not torch.equal(buffer, value):
                    buffer.copy_(value)
