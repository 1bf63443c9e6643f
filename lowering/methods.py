"""Several methods per program: one ``.pte`` with one execution plan per method.

Each method (e.g. ``encode`` and ``decode`` over one model's weights) is
exported, delegated and memory-planned on its own; this module checks the
method names and emits the methods into ONE program::

    {"decode": (program, plan), "encode": (program, plan)}
        ─► emit each method alone (lowering.emit.build_pte)
        ─► merge_methods: execution plans in name order, data pooled

    per method                           merged program
    constants   [b"", W, b1]             constants   [b"", W, b1, b2]  W (shared weight) once
    constants   [b"", W, b2]             plan encode: W->1 b1->2; plan decode: W->1 b2->3
    payloads    [P]   [P]                payloads    [P]               equal bytes stored once
    named_data  {k: w} {k: w}            named_data  {k: w}            keyed by content digest

Method order in the program is sorted by name (as ExecuTorch's emitter does),
whatever the order of the mapping, so the bytes depend only on the methods.

Constant methods (ExecuTorch's ``constant_methods``: an LLM's ``get_max_seq_len``,
``get_eos_ids``, ...) are plain values among the methods, split off by
:func:`split_constant_methods` and emitted after the traced ones, in name order
(:mod:`lowering.emit.constant_method`)::

    {"forward": (m, (x,)), "get_max_seq_len": 128}
        ─► plans [forward, get_max_seq_len]   get_max_seq_len: no inputs, returns Int 128

Mutable buffers are per method by default (each method's planned memory holds
its own state); two methods sharing one mutated buffer are rejected by
:func:`check_no_shared_state`.  With shared mutable buffers (ExecuTorch's
``MemoryPlanningPass(share_mutable_buffers=True)``), :func:`plan_shared_state`
gives every mutable buffer, by name, one place in a shared arena (mem_id 2)
that each method's memory plan uses::

    prefill: mutates cache.k, cache.v    ─┐   SharedState(offsets={"cache.k": 0,
    decode:  mutates cache.k, cache.v    ─┴─►              "cache.v": 4096}, size=8192)
    every method: cache.k at (mem_id 2, offset 0), initial value in the mutable
    segment once; a runtime holds one arena 2 per loaded program, so the
    methods read each other's writes.
"""

from __future__ import annotations

import keyword
from typing import Any, Iterable, Mapping

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .delegation import SHARED_STATE
from .errors import EmitError, LoweringError
from .pte import PteData, schema, serialize
from .pte.format import blob_key
from .delegation import same_blob


class MethodError(LoweringError):
    """A bad set of methods: a bad or duplicate name, a bad entry, state shared across methods."""


def check_method_name(name: Any, where: str = "methods") -> str:
    """``name`` if it can name a method (a Python identifier, not a keyword); else MethodError."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise MethodError(f"{where}: method name {name!r} must be a Python identifier")
    return name


def method_order(names: Iterable[str]) -> list[str]:
    """The order of methods in a program: sorted by name."""
    return sorted(names)


def emit_methods(methods: Mapping[str, tuple[ExportedProgram, Any]],
                 constants: Mapping[str, Any] | None = None, *, runtime_ops: Any = None) -> bytes:
    """The ``.pte`` holding every method of ``{name: (edge program, memory plan)}``
    and the constant methods ``{name: value}``; ``runtime_ops``: the runtime profile
    every method's operators are checked against."""
    return serialize(build_methods_pte(methods, constants, runtime_ops=runtime_ops))


def split_constant_methods(methods: Any, where: str = "methods") -> tuple[Any, dict[str, Any]]:
    """``(traced methods, {name: constant value})`` of a methods dict whose plain values
    (bool, int, float, str or a list of them) are constant methods."""
    from .emit.constant_method import is_constant_value

    if not isinstance(methods, Mapping):
        return methods, {}
    constants = {check_method_name(k, where): v for k, v in methods.items()
                 if not isinstance(v, (tuple, ExportedProgram)) and is_constant_value(v)}
    return {k: v for k, v in methods.items() if k not in constants}, constants


def build_methods_pte(methods: Mapping[str, tuple[ExportedProgram, Any]],
                      constants: Mapping[str, Any] | None = None, *, runtime_ops: Any = None,
                      external_weights: bool = False) -> PteData:
    """Emit each method alone, then :func:`merge_methods` (in name order), then the
    constant methods (in name order)."""
    from .emit.constant_method import constant_plan
    from .emit.method import build_pte

    if not methods:
        raise MethodError("methods: a program needs at least one method")
    initial_read = state_read_first({name: program for name, (program, _) in methods.items()})
    built = []
    for name in method_order(methods):
        check_method_name(name)
        program, plan = methods[name]
        try:
            built.append((name, build_pte(program, plan, runtime_ops=runtime_ops,
                                          external_weights=external_weights, initial_read=initial_read)))
        except EmitError as exc:
            raise type(exc)(f"method {name!r}: {exc}") from exc
    merged = merge_methods(built)
    clash = sorted(set(constants or ()) & set(methods))
    if clash:
        raise MethodError(f"methods: {clash} are both a method and a constant method")
    for name in method_order(constants or {}):
        merged.program.executionPlan.append(constant_plan(check_method_name(name), constants[name]))
    return merged


def state_read_first(programs: Mapping[str, ExportedProgram]) -> set[str]:
    """The mutable buffers (FQNs) whose initial value some method may read.

    A buffer every method using it writes before reading (a KV cache:
    :func:`lowering.mutating_ops.write_first_buffers`) is not among them, so the
    ``.pte`` stores no initial value for it, as for a program of one method::

        forward: update_cache(k_cache) -> custom_sdpa(k_cache)   get_max_seq_len: constant
        -> set()                      (the caches' zeros are not stored)
        prefill: update_cache(cache) ...   reset: reads cache    -> {"cache"}
    """
    from .mutating_ops import write_first_buffers

    read = set()
    for program in programs.values():
        signature = program.graph_signature
        mutations = {s.arg.name for s in signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
        written_first = write_first_buffers(program.graph, mutations)
        read.update(spec.target for spec in signature.input_specs
                    if spec.kind == InputKind.BUFFER and spec.arg.name not in written_first)
    return read


def merge_methods(methods: list[tuple[str, PteData]]) -> PteData:
    """One program from single-method ones: the plans renamed and concatenated, their
    data pooled.  Constants, mutable initial values, delegate payloads and named
    data with equal bytes are stored once.  The inputs' tables are modified (they are fresh from :func:`build_pte`).
    """
    names = [name for name, _ in methods]
    if len(set(names)) != len(names):
        raise MethodError(f"methods: duplicate method names in {names}")
    pool = _DataPool()
    plans = []
    for name, pte in methods:
        for plan in pte.program.executionPlan or []:
            plan.name = name
            pool.add_method(name, plan, pte)
            plans.append(plan)
    program = schema.ProgramT()
    program.version = 0
    program.executionPlan = plans
    return PteData(
        program=program,
        constants=pool.constants,
        mutable_data=pool.mutable_data if len(pool.mutable_data) > 1 else [],
        delegate_data=pool.payloads,
        named_data=pool.named_data,
        external=pool.external,
    )


class _DataPool:
    """The program-level data of merged methods, and the re-indexing of each plan into it."""

    def __init__(self) -> None:
        self.constants: list[bytes] = [b""]
        self._constant_index: dict[bytes, int] = {}
        self.mutable_data: list[bytes] = [b""]
        self._mutable_index: dict[bytes, int] = {}
        self.payloads: list[bytes] = []
        self._payload_index: dict[bytes, int] = {}
        self.named_data: dict[str, bytes] = {}
        self.external: dict = {}
        self._named_by: dict[str, str] = {}

    def add_method(self, name: str, plan: schema.ExecutionPlanT, pte: PteData) -> None:
        constants = [self._constant(data) if i else 0 for i, data in enumerate(pte.constants)]
        mutable = [self._mutable(data) if i else 0 for i, data in enumerate(pte.mutable_data)]
        for value in plan.values or []:
            if value.valType != schema.KernelTypes.Tensor or not value.val.dataBufferIdx:
                continue
            tensor = value.val
            table = constants if tensor.allocationInfo is None else mutable
            if tensor.dataBufferIdx >= len(table):
                kind = "constant" if tensor.allocationInfo is None else "mutable data"
                raise EmitError(f"method {name!r}: {kind} index {tensor.dataBufferIdx} has no data")
            tensor.dataBufferIdx = table[tensor.dataBufferIdx]
        payloads = [self._payload(bytes(data)) for data in pte.delegate_data]
        for delegate in plan.delegates or []:
            delegate.processed.index = payloads[delegate.processed.index]
        for key, blob in pte.named_data.items():
            if not same_blob(self.named_data.setdefault(key, blob), blob):
                raise EmitError(f"method {name!r}: named data key {key!r} is already used by method "
                                f"{self._named_by[key]!r} for different bytes")
            self._named_by.setdefault(key, name)
        for key, entry in pte.external.items():  # external weights: one .ptd for every method
            known = self.external.setdefault(key, entry)
            if known.layout != entry.layout or not same_blob(known.data, entry.data):
                raise EmitError(f"method {name!r}: external weight {key!r} is already used by method "
                                f"{self._named_by[key]!r} for different bytes or layout")
            self._named_by.setdefault(key, name)

    def _constant(self, data: bytes) -> int:
        key = blob_key(data)  # data may be a view of a weight (not hashable, never copied)
        if key not in self._constant_index:
            self._constant_index[key] = len(self.constants)
            self.constants.append(data)
        return self._constant_index[key]

    def _mutable(self, data: bytes) -> int:
        """Initial values are read-only sources copied into planned memory at load:
        equal bytes are stored once (a shared buffer's value is in every method)."""
        key = blob_key(data)
        if key not in self._mutable_index:
            self._mutable_index[key] = len(self.mutable_data)
            self.mutable_data.append(data)
        return self._mutable_index[key]

    def _payload(self, data: bytes) -> int:
        if data not in self._payload_index:
            self._payload_index[data] = len(self.payloads)
            self.payloads.append(data)
        return self._payload_index[data]


# --------------------------------------------------------------------------- method entries


def method_entries(methods: Any, where: str = "methods") -> dict[str, tuple]:
    """Check ``{name: (module, example_inputs[, dynamic_shapes]) | ExportedProgram}``.

    Returns ``{name: (module_or_program, inputs or None, dynamic_shapes or None)}``
    in name order; every bad entry is a MethodError naming the method.
    """
    if not isinstance(methods, Mapping) or not methods:
        raise MethodError(f"{where}: expected a non-empty dict {{method name: (module, example_inputs)}}")
    entries = {}
    for name in method_order(_names(methods, where)):
        value = methods[name]
        at = f"{where}: method {name!r}"
        if isinstance(value, ExportedProgram):
            entries[name] = (value, None, None)
            continue
        if not isinstance(value, (tuple, list)) or len(value) not in (2, 3):
            raise MethodError(f"{at}: expected (module, example_inputs[, dynamic_shapes]) or an "
                              f"ExportedProgram, got {type(value).__name__}")
        module, inputs, *rest = value
        if not isinstance(module, torch.nn.Module):
            raise MethodError(f"{at}: expected a torch.nn.Module, got {type(module).__name__}")
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        entries[name] = (module, inputs, rest[0] if rest else None)
    return entries


def _names(methods: Mapping, where: str) -> list[str]:
    return [check_method_name(name, where) for name in methods]


def mutated_buffers(program: ExportedProgram) -> list[str]:
    """The fully qualified names of the buffers ``program`` mutates, sorted."""
    return sorted(set(program.graph_signature.buffers_to_mutate.values()))


def state_written_elsewhere(mutated: Mapping[str, Iterable[str]], method: str) -> list[str]:
    """The buffers other methods mutate and ``method`` does not (``mutated``: per method,
    :func:`mutated_buffers`), sorted: with shared buffers, state ``method`` may only read."""
    own = set(mutated[method])
    return sorted({fqn for name, fqns in mutated.items() if name != method for fqn in fqns} - own)


def mark_shared_state(program: ExportedProgram, written_elsewhere: Iterable[str]) -> list[str]:
    """Mark the buffer placeholders of ``program`` another method writes (``SHARED_STATE``),
    so that no partition takes them as constant data; returns their names.

    Before::  %b_cross_k (BUFFER cross_k, not mutated here)   %mm = mm(%q, %b_cross_k) {tag: A}
              -> the partition stores cross_k's initial zeros as a constant
    After::   %b_cross_k {shared_state: True}: it stays top-level and is passed to the
              delegate at run time, holding what the writing method stored
    """
    elsewhere = set(written_elsewhere)
    marked = []
    for node, spec in zip(program.graph.find_nodes(op="placeholder"), program.graph_signature.input_specs):
        if spec.kind == InputKind.BUFFER and spec.target in elsewhere:
            node.meta[SHARED_STATE] = True
            marked.append(node.name)
    return marked


def check_no_shared_state(modules: Mapping[str, torch.nn.Module], mutated: Mapping[str, Iterable[str]]) -> None:
    """Raise MethodError if a buffer one method mutates is a tensor another method uses.

    ``mutated``: per method, the buffers its program mutates (:func:`mutated_buffers`).
    Each method of a program has its own planned memory, so state shared across
    methods in eager (a KV cache that ``prefill`` writes and ``decode`` reads)
    would silently diverge in the ``.pte``.
    """
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, module in modules.items():
        for fqn, tensor in _named_state(module):
            owners.setdefault(tensor.untyped_storage().data_ptr(), []).append((name, fqn))
    for name in sorted(mutated):
        module = modules.get(name)
        if module is None:
            continue
        state = dict(_named_state(module))
        for fqn in sorted(mutated[name]):
            tensor = state.get(fqn)
            if tensor is None:
                continue
            others = [(m, f) for m, f in owners.get(tensor.untyped_storage().data_ptr(), []) if m != name]
            if others:
                other, other_fqn = others[0]
                raise MethodError(
                    f"method {name!r} mutates buffer {fqn!r}, which method {other!r} also uses "
                    f"(as {other_fqn!r}); each method of a program has its own memory unless "
                    "mutable buffers are shared: pass share_mutable_buffers=True"
                )


def check_shared_state_names(modules: Mapping[str, torch.nn.Module], mutated: Mapping[str, Iterable[str]]) -> None:
    """Raise MethodError if a mutated buffer is one tensor under two names.

    Shared state is matched by buffer name (as in ExecuTorch), so the methods
    must reach a shared buffer under the same name (``prefill = Prefill(model)``,
    ``decode = Decode(model)``: both see ``model.cache_k``).
    """
    names: dict[int, tuple[str, str]] = {}
    for name in sorted(modules):
        state = dict(_named_state(modules[name]))
        for fqn in sorted(set(mutated.get(name, ())) & set(state)):
            names.setdefault(state[fqn].untyped_storage().data_ptr(), (name, fqn))
    for name in sorted(modules):
        for fqn, tensor in _named_state(modules[name]):
            first = names.get(tensor.untyped_storage().data_ptr())
            if first is not None and first[1] != fqn:
                raise MethodError(
                    f"method {name!r} uses buffer {first[1]!r} of method {first[0]!r} under another "
                    f"name, {fqn!r}; shared mutable buffers are matched by name: give the methods' "
                    "modules the same attribute path to the shared module"
                )


def plan_shared_state(programs: Mapping[str, ExportedProgram], alignment: int = 16):
    """The :class:`~lowering.memory_plan.SharedState` of ``{method: program}``.

    Every buffer any method mutates gets one place (buffer names sorted,
    offsets aligned, no reuse: state persists).  A buffer used by several
    methods must have the same dtype, shape and initial value in each, else
    MethodError naming the buffer and the methods.
    """
    from .memory_plan.plan import SharedState

    mutated = sorted({fqn for program in programs.values() for fqn in mutated_buffers(program)})
    first: dict[str, tuple[str, torch.Tensor]] = {}
    for name in method_order(programs):
        program = programs[name]
        buffers = {s.target for s in program.graph_signature.input_specs if s.kind == InputKind.BUFFER}
        for fqn in mutated:
            if fqn not in buffers:
                continue
            tensor = _state_tensor(program, fqn, name)
            seen = first.setdefault(fqn, (name, tensor))
            _check_same_state(fqn, seen, (name, tensor))
    offsets, size = {}, 0
    for fqn in mutated:
        tensor = first[fqn][1]
        offsets[fqn] = size
        size += -(-tensor.numel() * tensor.element_size() // alignment) * alignment
    return SharedState(offsets, size)


def plan_method_state(programs: Mapping[str, ExportedProgram], *, share: bool, alignment: int = 16):
    """``{method: SharedState}``: where each method's mutable buffers live, or None
    if no method mutates a buffer.

    ExecuTorch's runtime lets the methods of one program share their planned
    arenas (its Python runtime sizes one set to the largest method), so state in
    a method's arena 1 would be overwritten by another method's activations:
    state always goes to arena 2.  ``share``: one place per buffer name, the same
    in every method (:func:`plan_shared_state`); otherwise each method's buffers
    get a region of their own (regions in method name order)::

        share=False   step: count -> 0            other: state -> 256     size 512 in both
        share=True    prefill, decode: cache.k -> 0, cache.v -> 2048      size 4096 in both
    """
    from .memory_plan.plan import SharedState

    if not any(mutated_buffers(program) for program in programs.values()):
        return None
    if share:
        shared = plan_shared_state(programs, alignment)
        return {name: shared for name in programs}
    regions, base = {}, 0
    for name in method_order(programs):
        own = plan_shared_state({name: programs[name]}, alignment)
        regions[name] = {fqn: base + offset for fqn, offset in own.offsets.items()}
        base += own.size
    return {name: SharedState(offsets, base) for name, offsets in regions.items()}


def _state_tensor(program: ExportedProgram, fqn: str, method: str) -> torch.Tensor:
    tensor = program.state_dict.get(fqn, program.constants.get(fqn))
    if not isinstance(tensor, torch.Tensor):
        raise MethodError(f"method {method!r}: buffer {fqn!r} has no tensor in the program's state")
    return tensor.detach()


def _check_same_state(fqn: str, first: tuple[str, torch.Tensor], other: tuple[str, torch.Tensor]) -> None:
    (a, x), (b, y) = first, other
    if a == b:
        return
    if x.dtype != y.dtype or x.shape != y.shape:
        raise MethodError(f"shared buffer {fqn!r} is {x.dtype}{list(x.shape)} in method {a!r} but "
                          f"{y.dtype}{list(y.shape)} in method {b!r}; a shared buffer must be the same in every method")
    if not torch.equal(x, y):
        raise MethodError(f"shared buffer {fqn!r} has a different initial value in method {a!r} than in "
                          f"method {b!r}; a shared buffer must be the same in every method")


def _named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [(fqn, t) for fqn, t in named if t.device.type != "meta"]
