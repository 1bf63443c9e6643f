"""ExecuTorch's own backends as lowerflow targets: ``openvino``, ``vulkan``, ``coreml``,
``ethos-u``, ``qnn`` (an optional plugin: ``pip install 'lowerflow[executorch]'``, and
``lowerflow[openvino]`` / ``lowerflow[ethos-u]`` for those compilers).

The only place lowerflow imports ``executorch``, and only when a target is used:
nothing else imports this package; the ``lowerflow.backends`` entry points name its
classes (:mod:`.backends`).  Each target is partitioned by that backend's own
ExecuTorch partitioner and compiled by its own ``preprocess`` inside lowerflow's
stages (:mod:`.adapter`); lowerflow plans memory and emits.  OpenVINO's ``precision: f32``
marks the payload's layers precise, which its CPU plugin keeps at import (:mod:`.openvino`).  What each
target needs installed, and its options: :mod:`.targets`, :mod:`.options`,
``docs/executorch-backends.md``.
"""

from .backends import (
    CoreMLBackend,
    EthosUBackend,
    ExecutorchBackend,
    OpenvinoBackend,
    QnnBackend,
    VulkanBackend,
)
from .targets import TARGETS

__all__ = ["TARGETS", "CoreMLBackend", "EthosUBackend", "ExecutorchBackend", "OpenvinoBackend",
           "QnnBackend", "VulkanBackend"]
