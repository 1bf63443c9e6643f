"""Load a ``.pte`` and run its methods instruction by instruction.

Memory model (the same as ExecuTorch's):

- each ``non_const_buffer_sizes[i]`` (i >= 1) becomes one real byte arena;
  a tensor with ``allocation_info`` is a view of arena ``memory_id`` at its
  byte offset, so two tensors planned on the same bytes really share them;
- a tensor with ``data_buffer_idx > 0`` and no allocation is a constant read
  from the constant segment;
- a tensor with both is planned and gets its initial value from the mutable
  data segment when the method is loaded;
- method inputs are copied into their planned tensors; outputs are copied
  out of the arenas (the next call reuses the memory);
- a ``DYNAMIC_BOUND`` tensor's sizes are its upper bound: its bytes are
  reserved for that, and an input, a kernel or a delegate resizes it in place
  within them (a kernel's dynamic ``out`` tensor is emptied first, so the
  kernel resizes it to its result's shape at the same address).

A loaded method keeps its arenas, so state (mutable buffers, delegate
handles) persists across calls on it; :meth:`LoadedProgram.run` reuses one
loaded method per name.

The arenas belong to the loaded program, not to a method, as in ExecuTorch's
Python runtime: every method of one :class:`LoadedProgram` views the same
arena per memory id (sized to the largest method's request).  So the methods
overwrite each other's activations (outputs are copied out), and state in
arena 2 (:class:`lowering.memory_plan.SharedState`) is seen by every method:
``decode`` reads what ``prefill`` wrote.  As in ExecuTorch, a method copies
its initial values into the arenas when it is loaded: load every method before
running any (:meth:`LoadedProgram.load_all`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..delegation import CompileSpec
from ..pte import PteData, deserialize
from ..pte.format import decode_string, vector_bytes
from ..pte.generated import program_generated as fb
from ..pte.scalar_types import SCALAR_TYPE_TO_DTYPE, dim_order_strides
from .backends import backend_runtime, takes_named_data
from .errors import ExecutorError
from .kernels import Kernel, resolve_operator


def load(pte_bytes: bytes, data: bytes | None = None) -> "LoadedProgram":
    """Parse ``pte_bytes`` (a .pte from lowerflow or ExecuTorch) into a runnable program;
    ``data``: the ``.ptd`` its external weights are bound from (by key, as ExecuTorch's
    runtime binds them; check the pair first with :func:`lowering.external.check_pair`)."""
    pte = deserialize(pte_bytes)
    if data is not None:
        from ..pte.flat_tensor import deserialize_ptd

        pte.external = deserialize_ptd(data)
    return LoadedProgram(pte)


class LoadedProgram:
    """A parsed program; methods are loaded on first use and then kept."""

    def __init__(self, pte: PteData) -> None:
        self.pte = pte
        self._plans = {decode_string(plan.name): plan for plan in pte.program.executionPlan or []}
        self._methods: dict[str, LoadedMethod] = {}
        self.shared_arenas = _shared_arenas(self._plans.values())

    def load_all(self) -> "LoadedProgram":
        """Load every method (in program order); returns self."""
        for name in self._plans:
            self.method(name)
        return self

    @property
    def method_names(self) -> list[str]:
        return list(self._plans)

    def method(self, name: str = "forward") -> "LoadedMethod":
        """The loaded method ``name`` (loaded once; later calls return the same object)."""
        if name not in self._methods:
            if name not in self._plans:
                raise ExecutorError(f"program has no method {name!r}; methods: {self.method_names}")
            self._methods[name] = LoadedMethod(self._plans[name], self.pte, self.shared_arenas)
        return self._methods[name]

    def run(self, method_name: str = "forward", inputs: Sequence[Any] = ()) -> list[Any]:
        """Execute ``method_name`` on the flat list ``inputs``; returns the flat outputs."""
        return self.method(method_name).execute(inputs)


class _ListRef:
    """An IntList / TensorList / OptionalTensorList: EValue indices resolved at call time."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[int]) -> None:
        self.items = [int(i) for i in items]


@dataclass
class _Step:
    """One instruction in executable form."""

    kind: str  # "kernel", "delegate", "move", "jump_false", "free"
    target: Any = None  # Kernel, delegate index, ...
    args: tuple = ()
    split: int = 0  # delegate: number of input args


class LoadedMethod:
    """An execution plan with its arenas allocated, values built and kernels resolved."""

    def __init__(self, plan: fb.ExecutionPlanT, pte: PteData, shared_arenas: dict[int, torch.Tensor] | None = None) -> None:
        self.name = decode_string(plan.name)
        self._pte = pte
        shared = shared_arenas or {}
        self.arenas = [
            shared[mem_id] if mem_id in shared else torch.zeros(int(size), dtype=torch.uint8)
            for mem_id, size in enumerate(_ints(plan.nonConstBufferSizes))
        ]
        self._initialized: set[int] = set()
        #: DYNAMIC_BOUND tensor values -> their capacity in elements.
        self._capacity: dict[int, int] = {}
        self.values: list[Any] = [self._build_value(i, ev) for i, ev in enumerate(plan.values or [])]
        self.inputs = _ints(plan.inputs)
        self.outputs = _ints(plan.outputs)
        self.kernels = [resolve_operator(decode_string(op.name), decode_string(op.overload)) for op in plan.operators or []]
        self.delegates = [self._init_delegate(d) for d in plan.delegates or []]
        self.steps = self._compile_steps(plan)
        meta = plan.containerMetaType
        self.encoded_inp_str = decode_string(meta.encodedInpStr) if meta else ""
        self.encoded_out_str = decode_string(meta.encodedOutStr) if meta else ""

    # ---------------------------------------------------------------- loading

    def _build_value(self, index: int, evalue: fb.EValueT) -> Any:
        kind, val = evalue.valType, evalue.val
        if kind == fb.KernelTypes.Tensor:
            return self._build_tensor(index, val)
        if kind in (fb.KernelTypes.Null, fb.KernelTypes.NONE):
            return None
        if kind == fb.KernelTypes.Int:
            return int(val.intVal)
        if kind == fb.KernelTypes.Bool:
            return bool(val.boolVal)
        if kind == fb.KernelTypes.Double:
            return float(val.doubleVal)
        if kind == fb.KernelTypes.String:
            return decode_string(val.stringVal)
        if kind == fb.KernelTypes.DoubleList:
            return [float(x) for x in _ints(val.items)]
        if kind == fb.KernelTypes.BoolList:
            return [bool(x) for x in _ints(val.items)]
        if kind in (fb.KernelTypes.IntList, fb.KernelTypes.TensorList, fb.KernelTypes.OptionalTensorList):
            return _ListRef(_ints(val.items))
        raise ExecutorError(f"method {self.name!r}: value {index} has unknown type {kind}")

    def _build_tensor(self, index: int, table: fb.TensorT) -> torch.Tensor:
        if table.scalarType not in SCALAR_TYPE_TO_DTYPE:
            raise ExecutorError(f"method {self.name!r}: value {index} has unknown scalar type {table.scalarType}")
        dtype = SCALAR_TYPE_TO_DTYPE[table.scalarType]
        sizes = [int(s) for s in _ints(table.sizes)]
        dim_order = _ints(table.dimOrder) or list(range(len(sizes)))
        strides = dim_order_strides(sizes, dim_order)
        nbytes = _numel(sizes) * _element_size(dtype)
        if table.shapeDynamism == fb.TensorShapeDynamism.DYNAMIC_BOUND:
            self._capacity[index] = _numel(sizes)
        elif table.shapeDynamism != fb.TensorShapeDynamism.STATIC:
            raise ExecutorError(f"method {self.name!r}: value {index} has unbounded dynamic shape; "
                                "only STATIC and DYNAMIC_BOUND tensors are supported")
        allocation = table.allocationInfo
        if allocation is not None:
            tensor = self._arena_view(index, allocation, dtype, sizes, strides, nbytes)
            if table.dataBufferIdx:
                blob = self._blob(self._pte.mutable_data, table.dataBufferIdx, "mutable data", index)
                mem_id, offset = _location(allocation)
                self.arenas[mem_id][offset:offset + nbytes].copy_(_bytes_tensor(blob, nbytes))
                self._initialized.add(index)
            return tensor
        info = table.extraTensorInfo
        if info is not None and info.location == fb.TensorDataLocation.EXTERNAL:
            key = decode_string(info.fullyQualifiedName)
            if key not in self._pte.external:
                raise ExecutorError(f"method {self.name!r}: value {index} is the external weight {key!r}, "
                                    "which the program's data (.ptd) does not hold")
            flat = _bytes_tensor(self._pte.external[key].data, nbytes).view(dtype) if nbytes \
                else torch.empty(0, dtype=dtype)
            return flat.as_strided(sizes, strides)
        if table.dataBufferIdx:
            blob = self._blob(self._pte.constants, table.dataBufferIdx, "constant", index)
            flat = _bytes_tensor(blob, nbytes).view(dtype) if nbytes else torch.empty(0, dtype=dtype)
            return flat.as_strided(sizes, strides)
        # Neither planned nor constant: memory owned by the value itself.
        return torch.empty_strided(sizes, strides, dtype=dtype)

    def _arena_view(self, index, allocation, dtype, sizes, strides, nbytes) -> torch.Tensor:
        mem_id, offset = _location(allocation)
        if mem_id >= len(self.arenas) or mem_id == 0:
            raise ExecutorError(f"method {self.name!r}: value {index} is planned in memory {mem_id}, "
                                f"which has no arena ({len(self.arenas)} buffers)")
        arena = self.arenas[mem_id]
        if offset + nbytes > arena.numel():
            raise ExecutorError(f"method {self.name!r}: value {index} [{offset}, {offset + nbytes}) "
                                f"overflows arena {mem_id} of {arena.numel()} bytes")
        itemsize = _element_size(dtype)
        if offset % itemsize:
            raise ExecutorError(f"method {self.name!r}: value {index} offset {offset} is not aligned to {itemsize}")
        typed = arena[offset:offset + nbytes].view(dtype) if nbytes else torch.empty(0, dtype=dtype)
        return typed.as_strided(sizes, strides)

    def _blob(self, blobs: list[bytes], idx: int, what: str, index: int) -> bytes:
        if idx >= len(blobs):
            raise ExecutorError(f"method {self.name!r}: value {index} uses {what} buffer {idx} "
                                f"of only {len(blobs)}")
        return blobs[idx]

    def _init_delegate(self, delegate: fb.BackendDelegateT) -> tuple[Any, Any]:
        backend_id = decode_string(delegate.id)
        runtime = backend_runtime(backend_id)
        payload = self._pte.delegate_data[delegate.processed.index]
        specs = [CompileSpec(decode_string(s.key), vector_bytes(s.value)) for s in delegate.compileSpecs or []]
        if takes_named_data(runtime):
            named = self._pte.named_data
            if self._pte.external:
                named = {**named, **{key: entry.data for key, entry in self._pte.external.items()}}
            return runtime, runtime.init(payload, specs, named_data=named)
        return runtime, runtime.init(payload, specs)

    def _compile_steps(self, plan: fb.ExecutionPlanT) -> list[_Step]:
        defined = self._initially_defined()
        steps: list[_Step] = []
        for chain in plan.chains or []:
            for instruction in chain.instructions or []:
                step = self._compile_instruction(instruction, defined)
                defined.update(self._with_list_items(step.args))
                steps.append(step)
        return steps

    def _with_list_items(self, ids: Sequence[int]) -> set[int]:
        """``ids`` plus the items of the tensor/int lists among them."""
        found = set(ids)
        for i in ids:
            if 0 <= i < len(self.values) and type(self.values[i]) is _ListRef:
                found.update(self.values[i].items)
        return found

    def _initially_defined(self) -> set[int]:
        """Values holding data before any instruction runs: inputs, constants, non-tensors."""
        defined = set(self.inputs) | self._initialized
        for i, value in enumerate(self.values):
            if not isinstance(value, torch.Tensor) or not _is_arena_view(value, self.arenas):
                defined.add(i)
        return defined

    def _compile_instruction(self, instruction: fb.InstructionT, defined: set[int]) -> _Step:
        kind, args = instruction.instrArgsType, instruction.instrArgs
        if kind == fb.InstructionArguments.KernelCall:
            kernel = self.kernels[args.opIndex]
            arg_ids = tuple(_ints(args.args))
            if len(arg_ids) != kernel.num_args + kernel.num_results:
                raise ExecutorError(
                    f"method {self.name!r}: {kernel.qualified_name} takes {kernel.num_args} args and "
                    f"{kernel.num_results} result values, the instruction has {len(arg_ids)} values"
                )
            return _Step("kernel", kernel, arg_ids)
        if kind == fb.InstructionArguments.DelegateCall:
            # The args are the delegate's inputs followed by its outputs; the
            # format does not say where the outputs start (ExecuTorch hands a
            # backend all of them).  A runtime that knows its input count says
            # so; otherwise the outputs are the longest tail of values nothing
            # has written yet (not inputs, constants, state or earlier results).
            arg_ids = tuple(_ints(args.args))
            runtime, handle = self.delegates[args.delegateIndex]
            if callable(getattr(runtime, "num_inputs", None)):
                split = int(runtime.num_inputs(handle))
                if not 0 <= split <= len(arg_ids):
                    raise ExecutorError(
                        f"method {self.name!r}: delegate {args.delegateIndex} takes {split} inputs, "
                        f"the DelegateCall has {len(arg_ids)} values"
                    )
            else:
                split = len(arg_ids)
                while split > 0 and arg_ids[split - 1] not in defined:
                    split -= 1
            return _Step("delegate", args.delegateIndex, arg_ids, split)
        if kind == fb.InstructionArguments.MoveCall:
            return _Step("move", None, (args.moveFrom, args.moveTo))
        if kind == fb.InstructionArguments.JumpFalseCall:
            return _Step("jump_false", args.destinationInstruction, (args.condValueIndex,))
        if kind == fb.InstructionArguments.FreeCall:
            return _Step("free", None, (args.valueIndex,))
        raise ExecutorError(f"method {self.name!r}: unknown instruction type {kind}")

    # -------------------------------------------------------------- executing

    @torch.no_grad()
    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        """Run the method once on the flat ``inputs``; returns the flat outputs (copies).

        Inference only: kernels run without autograd, whatever the inputs require.
        """
        self._set_inputs(inputs)
        pc = 0
        while pc < len(self.steps):
            step = self.steps[pc]
            pc += 1
            if step.kind == "kernel":
                self._run_kernel(step.target, step.args)
            elif step.kind == "delegate":
                self._run_delegate(step)
            elif step.kind == "move":
                self.values[step.args[1]] = self.values[step.args[0]]
            elif step.kind == "jump_false":
                if not bool(self._resolve(step.args[0])):
                    pc = step.target
        return [self._output(i) for i in self.outputs]

    def _set_inputs(self, inputs: Sequence[Any]) -> None:
        if len(inputs) != len(self.inputs):
            raise ExecutorError(f"method {self.name!r} takes {len(self.inputs)} inputs, got {len(inputs)}")
        for position, (index, given) in enumerate(zip(self.inputs, inputs)):
            slot = self.values[index]
            if isinstance(slot, torch.Tensor):
                if not isinstance(given, torch.Tensor):
                    raise ExecutorError(f"method {self.name!r}: input {position} must be a tensor, got {type(given).__name__}")
                if index in self._capacity and given.dtype == slot.dtype and given.dim() == slot.dim():
                    self._resize(index, slot, tuple(given.shape), f"input {position}")
                elif given.dtype != slot.dtype or tuple(given.shape) != tuple(slot.shape):
                    raise ExecutorError(
                        f"method {self.name!r}: input {position} must be {slot.dtype}{list(slot.shape)}, "
                        f"got {given.dtype}{list(given.shape)}"
                    )
                slot.copy_(given)
            else:
                self.values[index] = given

    def _resize(self, index: int, slot: torch.Tensor, shape: tuple, what: str) -> None:
        """Resize a DYNAMIC_BOUND tensor in place (same address) within its capacity."""
        if _numel(shape) > self._capacity[index]:
            raise ExecutorError(f"method {self.name!r}: {what} of shape {list(shape)} exceeds the "
                                f"upper bound of {self._capacity[index]} elements")
        slot.resize_(shape)

    def _output(self, index: int) -> Any:
        value = self._resolve(index)
        return value.clone() if isinstance(value, torch.Tensor) else value

    def _resolve(self, index: int) -> Any:
        if index < 0:
            return None
        value = self.values[index]
        if type(value) is _ListRef:
            return [self._resolve(i) for i in value.items]
        return value

    def _run_kernel(self, kernel: Kernel, arg_ids: tuple) -> None:
        values = [self._resolve(i) for i in arg_ids[: kernel.num_args]]
        dynamic = self._dynamic_outs(kernel, arg_ids)
        before = [_layout(values[i], i in dynamic) for i in kernel.written]
        for ids in dynamic.values():
            for i in ids:  # emptied in place: the kernel resizes it to its result's shape
                self.values[i].resize_(0)
        try:
            result = kernel.call(values)
        except ExecutorError:
            raise
        except Exception as exc:
            raise ExecutorError(f"method {self.name!r}: kernel {kernel.qualified_name} failed: "
                                f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from exc
        after = [_layout(values[i], i in dynamic) for i in kernel.written]
        if before != after:
            raise ExecutorError(f"method {self.name!r}: kernel {kernel.qualified_name} resized its output "
                                f"(planned shape does not match the result)")
        for ids in dynamic.values():
            for i in ids:
                if self.values[i].numel() > self._capacity[i]:
                    raise ExecutorError(f"method {self.name!r}: kernel {kernel.qualified_name} result of "
                                        f"shape {list(self.values[i].shape)} exceeds its upper bound")
        if kernel.returns_value:
            self.values[arg_ids[-1]] = result

    def _dynamic_outs(self, kernel: Kernel, arg_ids: tuple) -> dict[int, list[int]]:
        """Written argument position -> its DYNAMIC_BOUND tensors (value ids) the kernel
        does not also read: those it may resize (at the same address)."""
        found = {}
        read = {arg_ids[i] for i in range(kernel.num_args) if i not in kernel.written}
        for position in kernel.written:
            index = arg_ids[position]
            value = self.values[index]
            items = value.items if type(value) is _ListRef else [index]
            dynamic = [i for i in items if i in self._capacity and i not in read]
            if dynamic:
                found[position] = dynamic
        return found

    def _run_delegate(self, step: _Step) -> None:
        runtime, handle = self.delegates[step.target]
        inputs = [self._resolve(i) for i in step.args[: step.split]]
        results = list(runtime.execute(handle, inputs))
        out_ids = step.args[step.split:]
        if len(results) != len(out_ids):
            raise ExecutorError(
                f"method {self.name!r}: delegate {step.target} returned {len(results)} values, "
                f"the DelegateCall has {len(out_ids)} outputs"
            )
        for index, result in zip(out_ids, results):
            slot = self.values[index]
            if isinstance(slot, torch.Tensor):
                if index in self._capacity and result.dim() == slot.dim():
                    self._resize(index, slot, tuple(result.shape), f"delegate {step.target} output")
                if tuple(result.shape) != tuple(slot.shape):
                    raise ExecutorError(f"method {self.name!r}: delegate {step.target} output shape "
                                        f"{tuple(result.shape)} != planned {tuple(slot.shape)}")
                slot.copy_(result)
            else:
                self.values[index] = result


def _shared_arenas(plans) -> dict[int, torch.Tensor]:
    """One arena per memory id >= 1 for all methods, as large as the largest request."""
    sizes: dict[int, int] = {}
    for plan in plans:
        for mem_id, size in enumerate(_ints(plan.nonConstBufferSizes)):
            if mem_id >= 1:
                sizes[mem_id] = max(sizes.get(mem_id, 0), int(size))
    return {mem_id: torch.zeros(size, dtype=torch.uint8) for mem_id, size in sizes.items()}


def _location(allocation: fb.AllocationDetailsT) -> tuple[int, int]:
    """(memory id, byte offset) of an allocation."""
    offset = int(allocation.memoryOffsetLow) | (int(allocation.memoryOffsetHigh) << 32)
    return int(allocation.memoryId), offset


def _ints(vector) -> list[int]:
    return [] if vector is None else [int(x) for x in vector]


def _bytes_tensor(blob: bytes, nbytes: int) -> torch.Tensor:
    if len(blob) < nbytes:
        raise ExecutorError(f"data buffer has {len(blob)} bytes, the tensor needs {nbytes}")
    return torch.frombuffer(bytearray(blob[:nbytes]), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _is_arena_view(tensor: torch.Tensor, arenas: list[torch.Tensor]) -> bool:
    storage = tensor.untyped_storage().data_ptr()
    return any(arena.numel() and storage == arena.untyped_storage().data_ptr() for arena in arenas)


def _layout(value: Any, dynamic: bool = False):
    """Address, shape and strides of a tensor (or of each tensor of a list);
    only the address of a dynamic one (its kernel resizes it)."""
    if isinstance(value, torch.Tensor):
        if dynamic:  # the address of its first element, whatever its size
            return value.untyped_storage().data_ptr() + value.storage_offset() * value.element_size()
        return value.data_ptr(), tuple(value.shape), value.stride()
    if isinstance(value, list):
        return [_layout(v, dynamic) for v in value]
    return None
