"""lowerflow's compiler library: ExecuTorch's lowering stages on torch alone.

    export ─► quantize (optional) ─► partition ─► create submodule ─► build ExportedProgram ─► preprocess
           ─► adjust original program ─► memory plan ─► emit
"""

from .backend_ops import FusedOp, apply_fused_ops, define_fused_op
from .delegate import executorch_call_delegate
from .errors import (
    BackendError,
    DynamicShapeError,
    EmitError,
    ExportError,
    FusedOpError,
    LoweringError,
    MemoryPlanError,
    PartitionError,
    QuantizeError,
    SubmoduleError,
)
from .export import export
from .lower import LowerResult, MethodsLowerResult, lower, lower_methods
from .methods import MethodError, emit_methods
from .lowered_module import BackendDetails, LoweredBackendModule, PreprocessResult
from .partition import (
    CompileSpec,
    DelegationSpec,
    OpSupportPartitioner,
    Partitioner,
    PartitionResult,
    tag_constant_data,
    tag_mutated_buffer,
)
from .quantize import RECIPE_NAMES, QuantRecipe, parse_recipe, quantize
from .to_backend import to_backend

__all__ = [
    "BackendDetails",
    "BackendError",
    "CompileSpec",
    "DelegationSpec",
    "DynamicShapeError",
    "EmitError",
    "ExportError",
    "FusedOp",
    "FusedOpError",
    "LowerResult",
    "LoweredBackendModule",
    "LoweringError",
    "MemoryPlanError",
    "MethodError",
    "MethodsLowerResult",
    "OpSupportPartitioner",
    "PartitionError",
    "PartitionResult",
    "Partitioner",
    "PreprocessResult",
    "QuantRecipe",
    "QuantizeError",
    "RECIPE_NAMES",
    "SubmoduleError",
    "apply_fused_ops",
    "define_fused_op",
    "executorch_call_delegate",
    "emit_methods",
    "export",
    "lower",
    "lower_methods",
    "parse_recipe",
    "quantize",
    "tag_constant_data",
    "tag_mutated_buffer",
    "to_backend",
]
