"""A target's options (manifest ``options: {coreml: {...}}``) checked, then made into
ExecuTorch's own partitioner with its compile specs.

:func:`check_options` needs no ExecuTorch (a typo is a bad manifest on any machine);
:func:`make_et_partitioner` imports the backend.  Each option maps to what ExecuTorch's
API for that backend takes::

    openvino  device: CPU                  CompileSpec("device", b"CPU") (the only spec its runtime reads)
              precision: f32               CompileSpec("precision", b"f32") (lowerflow's preprocess reads it)
    vulkan    force_fp16: true, ...        VulkanPartitioner(compile_options={...})
    coreml    compute_units: cpu_and_ne    CoreMLBackend.generate_compile_specs(compute_unit=..., ...)
    ethos-u   accelerator: ethos-u55-128   EthosUCompileSpec(target=..., system_config=..., memory_mode=...)
    qnn       soc_model: SM8650            generate_qnn_executorch_compiler_spec(soc_model=..., ...)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ...errors import BackendError
from .targets import EtTarget

_bool = (bool,)
_int = (int,)
_str = (str,)
_list = (list, tuple)

#: target -> option -> (types, allowed values or None, default)
OPTIONS: dict[str, dict[str, tuple[tuple[type, ...], tuple | None, Any]]] = {
    "openvino": {
        "device": (_str, None, "CPU"),
        "precision": (_str, ("f32", "default"), None),
        "op_types_to_skip": (_list, None, ()),
    },
    "vulkan": {
        **{k: (_bool, None, None) for k in (
            "force_fp16", "downcast_64_bit", "small_texture_limits", "skip_memory_planning",
            "alias_buffer_mutations", "skip_tag_memory_metadata", "require_dynamic_shapes", "skip_bool_tensors")},
        "buffer_limit": (_int, None, None),
        "texture_limits": (_list, None, None),
        "storage_type_override": (_str, None, None),
        "memory_layout_override": (_str, None, None),
        "nn_module_blocklist": (_list, None, None),
    },
    "coreml": {
        "compute_units": (_str, ("all", "cpu_only", "cpu_and_gpu", "cpu_and_ne"), "all"),
        "precision": (_str, ("fp16", "fp32"), "fp16"),
        "minimum_deployment_target": (_str, None, None),
        "model_type": (_str, ("model", "compiled_model"), "model"),
        "skip_ops": (_list, None, ()),
        "lower_full_graph": (_bool, None, False),
    },
    "ethos-u": {
        "accelerator": (_str, None, "ethos-u55-128"),
        "system_config": (_str, None, None),
        "memory_mode": (_str, None, None),
        "extra_flags": (_list, None, None),
    },
    "qnn": {
        "soc_model": (_str, None, "SM8650"),
        "use_fp16": (_bool, None, True),
    },
}


def check_options(target: EtTarget, options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``options`` with the target's defaults filled in; BackendError naming a bad one."""
    known = OPTIONS[target.name]
    options = dict(options or {})
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise BackendError(f"target {target.name!r}: unknown options {unknown}; it takes {sorted(known)}")
    full = {}
    for key, (types, allowed, default) in known.items():
        value = options.get(key, default)
        if value is None:
            continue
        if not isinstance(value, types) or (types is _int and isinstance(value, bool)):
            raise BackendError(f"target {target.name!r}: option {key!r} must be "
                               f"{' or '.join(t.__name__ for t in types)}, got {value!r}")
        if allowed is not None and value not in allowed:
            raise BackendError(f"target {target.name!r}: option {key}: {value!r} is not one of {list(allowed)}")
        full[key] = list(value) if isinstance(value, tuple) else value
    return full


def make_et_partitioner(target: EtTarget, options: Mapping[str, Any]):
    """ExecuTorch's own partitioner of ``target`` with ``options`` (checked by :func:`check_options`)."""
    try:
        return _MAKERS[target.name](options)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(f"target {target.name!r}: bad options {dict(options)}: {type(exc).__name__}: {exc}") from exc


#: The compile spec of ``openvino``'s ``precision: f32`` (lowerflow's; ExecuTorch's runtime reads only ``device``).
PRECISION_SPEC = "precision"


def _openvino(options):
    from executorch.backends.openvino.partitioner import OpenvinoPartitioner
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    specs = [CompileSpec("device", options["device"].encode())]
    if options.get("precision") == "f32":  # kept at import: .openvino.precise_payload (CPU only)
        if options["device"] != "CPU":
            raise BackendError(f"target 'openvino': precision f32 is for device CPU (the CPU plugin keeps layers "
                               f"marked precise at fp32), not {options['device']!r}")
        specs.append(CompileSpec(PRECISION_SPEC, b"f32"))
    return OpenvinoPartitioner(specs, op_types_to_skip=set(options["op_types_to_skip"]) or None)


def _vulkan(options):
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner
    from executorch.backends.vulkan.serialization.vulkan_graph_schema import VkMemoryLayout, VkStorageType

    compile_options = {k: v for k, v in options.items() if k != "nn_module_blocklist"}
    for key, enum in (("storage_type_override", VkStorageType), ("memory_layout_override", VkMemoryLayout)):
        if key in compile_options:
            name = compile_options[key]
            if name not in enum.__members__:
                raise BackendError(f"target 'vulkan': option {key}: {name!r} is not one of {list(enum.__members__)}")
            compile_options[key] = enum[name]
    if "texture_limits" in compile_options:
        compile_options["texture_limits"] = tuple(int(v) for v in compile_options["texture_limits"])
    return VulkanPartitioner(compile_options or None, nn_module_blocklist=options.get("nn_module_blocklist"))


def _coreml(options):
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner

    target = None
    if "minimum_deployment_target" in options:
        target = getattr(ct.target, options["minimum_deployment_target"], None)
        if target is None:
            raise BackendError(f"target 'coreml': option minimum_deployment_target: "
                               f"{options['minimum_deployment_target']!r} is not one of "
                               f"{[t.name for t in ct.target]}")
    specs = CoreMLBackend.generate_compile_specs(
        compute_unit=ct.ComputeUnit[options["compute_units"].upper()],
        minimum_deployment_target=target,
        compute_precision={"fp16": ct.precision.FLOAT16, "fp32": ct.precision.FLOAT32}[options["precision"]],
        model_type=CoreMLBackend.MODEL_TYPE[options["model_type"].upper()],
    )
    return CoreMLPartitioner(compile_specs=specs, skip_ops_for_coreml_delegation=list(options["skip_ops"]) or None,
                             lower_full_graph=options["lower_full_graph"])


def _ethos_u(options):
    from executorch.backends.arm.ethosu import EthosUPartitioner

    return EthosUPartitioner(ethos_u_spec(options))


def ethos_u_spec(options):
    """The ``EthosUCompileSpec`` of checked ``ethos-u`` options (its partitioner's and its quantizer's)."""
    from executorch.backends.arm.ethosu import EthosUCompileSpec

    return EthosUCompileSpec(options["accelerator"], system_config=options.get("system_config"),
                             memory_mode=options.get("memory_mode"), extra_flags=options.get("extra_flags"))


def ethos_u_quantizer(options, recipe):
    """Arm's ``EthosUQuantizer`` with its symmetric int8 config for recipe ``int8`` (what ExecuTorch's
    Ethos-U flow quantizes with, and what its partitioner takes); None for another recipe."""
    if recipe.name != "int8":
        return None
    from executorch.backends.arm.quantizer import EthosUQuantizer, get_symmetric_quantization_config

    quantizer = EthosUQuantizer(ethos_u_spec(options))
    quantizer.set_global(get_symmetric_quantization_config())
    return quantizer


#: target -> (options, recipe) -> the backend's own PT2E quantizer (None: lowerflow's recipe applies).
QUANTIZERS: dict[str, Callable[[Mapping[str, Any], Any], Any]] = {"ethos-u": ethos_u_quantizer}


def _qnn(options):
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    soc = getattr(QcomChipset, options["soc_model"], None)
    if soc is None:
        raise BackendError(f"target 'qnn': option soc_model: {options['soc_model']!r} is not one of "
                           f"{[c.name for c in QcomChipset]}")
    specs = generate_qnn_executorch_compiler_spec(
        soc_model=soc, backend_options=generate_htp_compiler_spec(use_fp16=options["use_fp16"]))
    return QnnPartitioner(specs)


_MAKERS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "openvino": _openvino, "vulkan": _vulkan, "coreml": _coreml, "ethos-u": _ethos_u, "qnn": _qnn,
}
