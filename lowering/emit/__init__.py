"""Stage 8 — emit: an edge-form ExportedProgram + its MemoryPlan -> ``.pte`` bytes.

One method, ``forward``, one chain.  The program is walked in graph order:

- placeholders: parameters, lifted constants and non-mutated buffers become
  constant tensors (deduplicated bytes in the constant segment); user inputs
  and mutated buffers become planned tensors (a mutated buffer's initial value
  goes to the mutable data segment, which the runtime copies into the planned
  memory when the method is loaded; a buffer every call writes before it reads
  it, a KV cache of ``llama::update_cache`` + ``llama::custom_sdpa``
  (:func:`lowering.mutating_ops.write_first_buffers`), gets none, as in ExecuTorch);
- ATen calls become KernelCalls of the out variant chosen by the memory plan
  (``aten::add`` + overload ``out``) with args in out-variant schema order,
  followed by the out tensor (or a TensorList of the out tensors), as
  ExecuTorch's emitter does;
- ``view_copy`` nodes the plan aliases onto their base need no instruction:
  their tensor is described at the base's memory with the view's shape;
- ``executorch_call_delegate`` becomes a BackendDelegate (payload in a
  segment, deduplicated) and a DelegateCall whose args are the inputs followed
  by the outputs; the lowered module's named data (weights keyed by sha256)
  goes to the program's ``named_data`` table, each distinct blob one segment;
- mutated buffers are written back at the end with ``aten::copy_``, so the new
  state is in the buffer's planned memory for the next call;
- dynamic shapes: a tensor with a symbolic size is ``DYNAMIC_BOUND`` with its
  sizes at the upper bound (the memory plan reserves that much; the runtime
  resizes it within); a symbolic scalar op (``sym_size``, ``operator.add`` on
  SymInts, ...) is a KernelCall of the runtime's prim op
  (:data:`lowering.dynamic.SYM_OPS`) whose args are its operands followed by
  an Int (Bool, Double) value the op writes, as ExecuTorch's emitter does.
- ``cond`` / ``map_impl`` inline their branches / body (values keyed
  ``"<submodule>/<node>"``) between jumps: see :mod:`lowering.emit.control_flow`.

Values are keyed like the memory plan: a node's name, or ``"<name>.<i>"`` for
output ``i`` of a multi-output node.

The rooms of this package (this file only re-exports their public names):
:mod:`~lowering.emit.method` (the method emitter, :func:`emit_program`,
:func:`build_pte`), :mod:`~lowering.emit.evalues` (the table builders) and
:mod:`~lowering.emit.control_flow` (the cond / map case).
"""

from .method import METHOD_NAME, MethodEmitter, build_pte, emit_program

__all__ = ["METHOD_NAME", "MethodEmitter", "build_pte", "emit_program"]
