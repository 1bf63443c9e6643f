"""lowerflow's own executor of ``.pte`` programs (ours and ExecuTorch's).

    program = load(pte_bytes)
    outputs = program.run("forward", [x])        # flat list of output values

Kernels are ATen out variants (``torch.ops.aten.<name>.<overload>``) writing
into views of real, planned memory arenas, so a wrong memory plan gives wrong
numbers.  DelegateCalls go to Python backend runtimes registered with
:func:`register_backend_runtime`.
"""

from .backends import backend_runtime, register_backend_runtime, unregister_backend_runtime
from .errors import ExecutorError
from .executor import LoadedMethod, LoadedProgram, load

__all__ = [
    "ExecutorError",
    "LoadedMethod",
    "LoadedProgram",
    "backend_runtime",
    "load",
    "register_backend_runtime",
    "unregister_backend_runtime",
]
