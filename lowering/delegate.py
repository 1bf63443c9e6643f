"""The ``executorch_call_delegate`` higher-order op.

torch ships it (``torch._higher_order_ops.executorch_call_delegate``) with the
implementations a lowered module needs: CPU (runs the lowered module's original
program), fake tensors, proxy tracing (make_fx / torch.export), functionalization
and autograd.  lowerflow uses torch's op rather than registering a second one,
so programs containing delegate calls are the same objects ExecuTorch and
torch.export's serializer know.  The op recognises a lowered module by its
class name, ``LoweredBackendModule``.
"""

from torch._higher_order_ops.executorch_call_delegate import (
    executorch_call_delegate,
    get_lowered_module_name,
    is_lowered_module,
)

__all__ = ["executorch_call_delegate", "get_lowered_module_name", "is_lowered_module"]
