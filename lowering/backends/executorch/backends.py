"""The targets' backends: lowerflow ``BackendDetails`` named like ExecuTorch's classes.

A delegate's id in the ``.pte`` is the backend class's name, and the stock runtime
dispatches on it, so ``OpenvinoBackend`` here writes delegates the runtime's
``OpenvinoBackend`` loads.  Each class:

- ``check_available()``: BackendError naming the extra (or ``QNN_SDK_ROOT``) to
  install; :func:`lowering.targets.check_target` calls it before any model runs;
- ``partitioner(**options)``: the options checked, then ExecuTorch's own partitioner
  wrapped as a lowerflow :class:`~lowering.partition.Partitioner` (:mod:`.adapter`);
- ``preprocess``: ExecuTorch's own ``preprocess`` (OpenVINO ``precision: f32``: its
  payload's layers then marked precise, :mod:`.openvino`);
- ``compiler_versions()``: executorch's and the vendor compiler's versions, in
  the preprocess stage's cache key (a new coremltools recompiles);
- ``verify_tolerance(options)``: the fp tolerance its outputs are checked with
  (None: fp32's).
"""

from __future__ import annotations

import abc
import functools
import importlib
from typing import Any

from ...delegation import BackendDetails, PreprocessResult
from .adapter import EtPartitioner, et_edge_program, et_preprocess, quiet
from .coreml import deterministic_payload
from .openvino import compile_precise
from .options import PRECISION_SPEC, QUANTIZERS, check_options, make_et_partitioner
from .targets import TARGETS, EtTarget, check_available, compiler_versions


class ExecutorchBackend(BackendDetails):
    """What every ExecuTorch backend target shares; subclasses name one :class:`EtTarget`
    (until one does, the class is abstract: never a backend found by name)."""

    @property
    @abc.abstractmethod
    def target(self) -> EtTarget: ...

    @classmethod
    def check_available(cls) -> None:
        check_available(cls.target)

    @classmethod
    def partitioner(cls, **options: Any) -> EtPartitioner:
        cls.check_available()
        full = check_options(cls.target, options)
        quantizer = QUANTIZERS.get(cls.target.name)
        return EtPartitioner(cls.target.backend_id, make_et_partitioner(cls.target, full),
                             quantizer_for=None if quantizer is None else functools.partial(quantizer, full))

    @classmethod
    def compiler_versions(cls) -> dict[str, str]:
        return compiler_versions(cls.target)

    @classmethod
    def verify_tolerance(cls, options: dict | None) -> float | None:
        return None

    @classmethod
    def et_backend(cls):
        """ExecuTorch's own BackendDetails class of this target."""
        cls.check_available()
        from executorch.exir.backend.backend_details import BackendDetails as EtBackendDetails

        importlib.import_module(cls.target.module)
        for sub in _subclasses(EtBackendDetails):
            if sub.__name__ == cls.target.backend_id:
                return sub
        raise LookupError(f"ExecuTorch has no backend {cls.target.backend_id!r} in {cls.target.module}")

    @classmethod
    def preprocess(cls, edge_program, compile_specs) -> PreprocessResult:
        return et_preprocess(cls.et_backend(), edge_program, compile_specs)


def _subclasses(cls: type) -> list[type]:
    found, stack = [], list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        found.append(sub)
        stack.extend(sub.__subclasses__())
    return found


class OpenvinoBackend(ExecutorchBackend):
    """ExecuTorch's OpenVINO partitioner and preprocess; ``precision: f32`` marks the payload.

    Precision: the payload is OpenVINO's compiled-model export, and the stock runtime
    imports it with ``ov_core_import_model(blob, device)``, no properties: the device's
    default ``INFERENCE_PRECISION_HINT`` applies at load, whatever hint the blob was
    compiled with (measured: compiled with f32, imported bf16 on an AMX CPU, 1e-3 error).
    ``precision: f32`` compiles without snippets and marks every layer of the payload's
    model precise, which the CPU plugin keeps at fp32 at import (:mod:`.openvino`); by default verify holds the program
    to the precision this machine's OpenVINO uses (:meth:`verify_tolerance`).
    """

    target = TARGETS["openvino"]

    @classmethod
    def preprocess(cls, edge_program, compile_specs) -> PreprocessResult:
        specs = {s.key: bytes(s.value).decode() for s in compile_specs}
        if specs.pop(PRECISION_SPEC, None) != "f32":
            return super().preprocess(edge_program, compile_specs)
        cls.check_available()
        with quiet():
            return PreprocessResult(compile_precise(et_edge_program(edge_program), specs))

    @classmethod
    def verify_tolerance(cls, options: dict | None) -> float | None:
        if (options or {}).get("precision") == "f32":
            return None
        return DEFAULT_PRECISION_TOLERANCE.get(openvino_default_precision((options or {}).get("device", "CPU")))


#: atol = rtol by inference precision (None: fp32's default).
DEFAULT_PRECISION_TOLERANCE = {"bf16": 2e-2, "f16": 5e-3}


def openvino_default_precision(device: str) -> str | None:
    """The inference precision OpenVINO's ``device`` runs a model at by default here
    (``bf16`` on CPUs with AMX / avx512_bf16); None when openvino cannot be asked."""
    try:
        import openvino

        hint = openvino.Core().get_property(device, "INFERENCE_PRECISION_HINT")
    except Exception:
        return None
    return getattr(hint, "type_name", str(hint))  # an openvino Type: "bf16", "f16", "f32"


class VulkanBackend(ExecutorchBackend):
    target = TARGETS["vulkan"]

    @classmethod
    def verify_tolerance(cls, options: dict | None) -> float | None:
        return 5e-3 if (options or {}).get("force_fp16") else None


class CoreMLBackend(ExecutorchBackend):
    """ExecuTorch's Core ML preprocess, its payload made deterministic.

    ExecuTorch names every Core ML model ``executorch_<uuid4>``, coremltools gives the
    mlpackage's manifest entries random uuids, writes protobuf maps in a per-process order
    and the day's date: two lowerings of one model never give the same bytes.
    :func:`.coreml.deterministic_payload` makes each canonical (uuids derived from the
    payload's own bytes: another partition, another identifier, which the device runtime
    caches compiled models by).
    """

    target = TARGETS["coreml"]

    @classmethod
    def preprocess(cls, edge_program, compile_specs) -> PreprocessResult:
        result = super().preprocess(edge_program, compile_specs)
        return PreprocessResult(deterministic_payload(result.processed_bytes), result.debug_handle_map,
                                result.named_data)

    @classmethod
    def verify_tolerance(cls, options: dict | None) -> float | None:
        return None if (options or {}).get("precision") == "fp32" else 5e-3


class EthosUBackend(ExecutorchBackend):
    target = TARGETS["ethos-u"]


class QnnBackend(ExecutorchBackend):
    target = TARGETS["qnn"]
