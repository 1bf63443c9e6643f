"""The ExecuTorch backends lowerflow offers as targets, and what each needs installed.

Nothing here imports ``executorch``: the CLI, manifests and ``lowerflow --help`` list
these targets, and :func:`check_available` says in one line what is missing, on a
machine without the extra.

=========  ====================  ==========================  =========================================
target     backend id (runtime)  pip extra                   vendor compiler (versions in the cache key)
=========  ====================  ==========================  =========================================
openvino   OpenvinoBackend       ``lowerflow[openvino]``     openvino, nncf
vulkan     VulkanBackend         ``lowerflow[executorch]``   (ExecuTorch's own serializer)
coreml     CoreMLBackend         ``lowerflow[executorch]``   coremltools
ethos-u    EthosUBackend         ``lowerflow[ethos-u]``      ethos-u-vela, tosa-tools
qnn        QnnBackend            ``lowerflow[executorch]``   the QNN SDK at ``$QNN_SDK_ROOT``
=========  ====================  ==========================  =========================================
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from importlib import metadata
from pathlib import Path

from ...errors import BackendError


@dataclasses.dataclass(frozen=True)
class EtTarget:
    """One ExecuTorch backend as a lowerflow target."""

    #: What users type (``-t coreml``).
    name: str
    #: The ExecuTorch ``BackendDetails`` class name: the id its runtime dispatches on.
    backend_id: str
    #: Where ExecuTorch keeps its partitioner / preprocess.
    module: str
    #: The pip extra of lowerflow that installs what it needs.
    extra: str
    #: Python modules its compiler imports (checked before any work).
    needs: tuple[str, ...]
    #: Distributions whose versions decide the compiled bytes (in the preprocess key).
    compilers: tuple[str, ...] = ()
    #: An environment variable naming an SDK the compiler needs (QNN).
    sdk_env: str | None = None


TARGETS: dict[str, EtTarget] = {t.name: t for t in (
    EtTarget("openvino", "OpenvinoBackend", "executorch.backends.openvino", "openvino",
             ("executorch", "openvino", "nncf"), ("openvino", "nncf")),
    EtTarget("vulkan", "VulkanBackend", "executorch.backends.vulkan", "executorch", ("executorch",)),
    EtTarget("coreml", "CoreMLBackend", "executorch.backends.apple.coreml", "executorch",
             ("executorch", "coremltools"), ("coremltools",)),
    EtTarget("ethos-u", "EthosUBackend", "executorch.backends.arm", "ethos-u",
             ("executorch", "ethosu.vela", "tosa_serializer"), ("ethos-u-vela", "tosa-tools")),
    EtTarget("qnn", "QnnBackend", "executorch.backends.qualcomm", "executorch", ("executorch",),
             sdk_env="QNN_SDK_ROOT"),
)}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


def check_available(target: EtTarget) -> None:
    """Raise BackendError (one line naming what to install) unless ``target`` can compile here."""
    for module in target.needs:
        if not _importable(module):
            raise BackendError(
                f"target {target.name!r} needs the Python module {module!r}, which is not installed: "
                f"pip install 'lowerflow[{target.extra}]'")
    if target.sdk_env is not None:
        root = os.environ.get(target.sdk_env, "")
        if not root or not Path(root).is_dir():
            raise BackendError(
                f"target {target.name!r} needs the vendor SDK: set {target.sdk_env} to its directory "
                f"({target.sdk_env}={root!r} is {'unset' if not root else 'not a directory'}); "
                "it is not on PyPI")


def compiler_versions(target: EtTarget) -> dict[str, str]:
    """The versions of executorch and of the target's vendor compiler (what a compile's key holds)."""
    versions = {}
    for dist in ("executorch", *target.compilers):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "missing"
    if target.sdk_env is not None:
        versions[target.sdk_env] = sdk_version(os.environ.get(target.sdk_env, ""))
    return versions


def sdk_version(root: str) -> str:
    """A vendor SDK's version: its ``sdk.yaml`` / ``version`` file's text, else its directory name."""
    if not root:
        return "unset"
    for name in ("sdk.yaml", "version", "VERSION"):
        path = Path(root) / name
        if path.is_file():
            return path.read_text(errors="replace").strip()[:200]
    return Path(root).resolve().name
