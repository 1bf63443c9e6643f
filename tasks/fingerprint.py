"""Model fingerprints: what the export stage's cache key is made of.

A fingerprint covers everything that decides the exported program, computed
without exporting (the factory runs; nothing is traced):

* ``weights``     every parameter and buffer, and every plain tensor attribute,
                  by name, dtype, shape and bytes (blake3 of the raw bytes: a
                  cryptographic hash at 3-5 GB/s here, 2-3x sha256's 1.5 GB/s);
* ``code``        the source files of the modules that define the classes in the
                  model tree (and their base classes), the factory's module, and
                  the project files those import, transitively (by content, labelled
                  by module name, never by absolute path); for code that comes from
                  an installed distribution (``transformers``, ``torch``), its
                  ``name==version`` instead of its files;
* ``attributes``  each submodule's class and plain (non-tensor) attributes:
                  hyper-parameters such as ``eps`` or a config object's ``to_dict()``,
                  and ``training``;
* ``inputs``      the example inputs' tree structure, dtypes, shapes and values,
                  and the dynamic shapes (each Dim's name, min and max) if any;
* ``options``     the export options and the manifest's ``version`` (a salt).

For a ``.pt2`` model the fingerprint is the file's sha256 (its bytes are the program).
For an ``hf:`` model (:func:`fingerprint_hf`) it is its directory's files by role,
``weights`` (``*.safetensors``, ``*.bin``, ...), ``tokenizer`` (tokenizer, vocabulary and
processor files), ``config`` (``config.json``, ``generation_config.json``, the rest),
``code`` (``transformers``' version, remote-code ``*.py`` files) and ``options`` (task,
``max_seq_len``, dtype, attn, ``version``): blake3 of each file's bytes, by relative path.

The fingerprint is a small JSON document of per-part digests (what a model
manifest records, so a user can see *why* a model re-lowered) plus the details
that explain them (file digests, distribution versions).  Its :attr:`digest` is
what the export and verify stages are keyed on.

A project file is a source file outside the Python installation (stdlib and
site-packages); everything under site-packages is identified by its distribution.
Editable installs (``pip install -e``) are project files, so editing them
re-lowers.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import math
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch.utils import _pytree as pytree

#: Bumped when the fingerprint document changes shape.
FINGERPRINT_FORMAT = 1
#: The parts a fingerprint digests, in the order they are reported.
PARTS = ("weights", "code", "attributes", "inputs", "options")


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """Per-part digests (``parts``), what explains them (``details``), and the whole ``digest``."""

    kind: str  # "factory" or "pt2"
    parts: Mapping[str, str]
    details: Mapping[str, Any]
    #: The digest of the weights' names, dtypes, shapes and ties, without their bytes
    #: (:func:`weights_digest`); None where it is not known (a .pt2, an hf: directory).
    layout: str | None = dataclasses.field(default=None, compare=False)

    @property
    def digest(self) -> str:
        return _sha256_json({"format": FINGERPRINT_FORMAT, "kind": self.kind, "parts": dict(self.parts)})

    @property
    def structure_digest(self) -> str | None:
        """The digest of everything but the weights' values: the same parts with the weights
        part replaced by their :attr:`layout` (what the graph stages of a model lowered with
        external weights are keyed on: :mod:`flows.weights_only`).  None without a layout."""
        if self.layout is None:
            return None
        parts = {**self.parts, "weights": f"layout:{self.layout}"}
        return _sha256_json({"format": FINGERPRINT_FORMAT, "kind": self.kind, "parts": parts})

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "kind": self.kind, "parts": dict(self.parts), **dict(self.details)}

    @staticmethod
    def changed(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> list[str] | None:
        """The parts that differ between two fingerprint documents (``to_json``);
        None when there is nothing to compare with (first lowering)."""
        if not before or "parts" not in before:
            return None
        old, new = before.get("parts") or {}, after.get("parts") or {}
        return [p for p in sorted(set(old) | set(new), key=_part_order) if old.get(p) != new.get(p)]


def _part_order(part: str) -> tuple[int, str]:
    return (PARTS.index(part) if part in PARTS else len(PARTS), part)


# --------------------------------------------------------------------------- entry points


def fingerprint_module(
    module: torch.nn.Module,
    inputs: tuple[Any, ...],
    *,
    factory_module: types.ModuleType | None = None,
    options: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
) -> Fingerprint:
    """The fingerprint of a live model (see the module docstring).

    ``dynamic_shapes`` is the JSON form (:func:`lowering.dynamic.dynamic_shapes_to_json`);
    None (static shapes) leaves the inputs digest as it always was.
    """
    weights, weight_details, layout = weights_digest(module)
    code, code_details = code_digest(module, factory_module)
    return Fingerprint(
        "factory",
        {
            "weights": weights,
            "code": code,
            "attributes": _sha256_json(attributes_document(module)),
            "inputs": _sha256_json(inputs_document(inputs, dynamic_shapes)),
            "options": _sha256_json(_plain(dict(options or {}))),
        },
        {"weights": weight_details, "code": code_details},
        layout,
    )


def fingerprint_methods(methods: Mapping[str, Fingerprint]) -> Fingerprint:
    """The fingerprint of a model of several methods, from each method's own.

    Each part digests that part of every method, by name; the ``methods`` part
    digests the method names, so adding, removing or renaming a method changes
    the digest (and the manifest says ``methods`` changed).  The details hold
    each method's fingerprint document.
    """
    names = sorted(methods)
    parts = {part: _sha256_json({name: methods[name].parts.get(part) for name in names}) for part in PARTS}
    parts["methods"] = _sha256_json(names)
    layouts = [methods[name].layout for name in names]
    layout = None if None in layouts else _sha256_json(dict(zip(names, layouts)))
    return Fingerprint("methods", parts, {"methods": {name: methods[name].to_json() for name in names}}, layout)


def fingerprint_pt2(data: bytes, options: Mapping[str, Any] | None = None) -> Fingerprint:
    """The fingerprint of a ``.pt2`` program: its bytes, and the options."""
    return Fingerprint(
        "pt2",
        {"program": hashlib.sha256(data).hexdigest(), "options": _sha256_json(_plain(dict(options or {})))},
        {"bytes": len(data)},
    )


#: File roles of an hf: model directory, by name pattern (the rest is ``config``).
HF_WEIGHTS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack",
              "*.safetensors.index.json", "*.bin.index.json")
HF_TOKENIZER = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                "*.model", "*.tiktoken", "chat_template*", "preprocessor_config.json", "processor_config.json")


def fingerprint_hf(directory: str | Path, options: Mapping[str, Any] | None, transformers_version: str,
                   method: str | None = None, digests: dict[Path, str] | None = None) -> Fingerprint:
    """The fingerprint of an ``hf:`` model's directory (see the module docstring);
    with ``method``, of that method of its program (one more part, the method's name).
    ``digests``: the files' digests already taken by this caller (path -> digest; filled
    in here), so fingerprinting a model and each of its methods reads each file once."""
    files = hf_files(directory, digests)
    code = {"transformers": transformers_version, "files": files["code"]}
    parts = {
        "weights": _sha256_json(files["weights"]),
        "tokenizer": _sha256_json(files["tokenizer"]),
        "config": _sha256_json(files["config"]),
        "code": _sha256_json(code),
        "options": _sha256_json(_plain(dict(options or {}))),
    }
    if method is not None:
        parts["method"] = _sha256_json(method)
    return Fingerprint("hf", parts, {"files": {role: sorted(names) for role, names in files.items()},
                                     "transformers": transformers_version},
                       safetensors_layout(Path(directory) / name for name in files["weights"]))


def safetensors_layout(paths: Iterable[Path]) -> str | None:
    """The layout digest (:attr:`Fingerprint.layout`) of an hf: model's weight files: every
    tensor's name, dtype and shape from the safetensors headers (no weight byte read; the
    shards it is split into do not count).  None where a weights file is not safetensors
    (a pickle checkpoint: its layout is not known without reading it)::

        model.safetensors header {"lm_head.weight": {"dtype": "F32", "shape": [128, 32], ...}, ...}
            ─► blake3([["lm_head.weight", "F32", [128, 32], null], ...])
    """
    import blake3

    entries = []
    for path in paths:
        if path.name.endswith(".index.json"):
            continue  # which shard holds which tensor: the headers name every tensor
        if not path.name.endswith(".safetensors"):
            return None
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size)) if 0 < size <= 100_000_000 else None
        except (OSError, ValueError):
            return None
        if not isinstance(header, dict):
            return None
        entries += [[name, info.get("dtype"), info.get("shape"), None] for name, info in header.items()
                    if name != "__metadata__" and isinstance(info, dict)]
    return blake3.blake3(_canonical(sorted(entries, key=lambda e: e[0]))).hexdigest()


def hf_files(directory: str | Path, digests: dict[Path, str] | None = None) -> dict[str, dict[str, str]]:
    """An ``hf:`` model directory's files by role (``weights``, ``tokenizer``, ``config``,
    ``code``): ``{role: {relative path: blake3 of its bytes}}``.  ``digests``: as
    :func:`fingerprint_hf`'s (each file is read once per caller)."""
    digests = {} if digests is None else digests
    root = Path(directory)
    files: dict[str, dict[str, str]] = {"weights": {}, "tokenizer": {}, "config": {}, "code": {}}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root)
        if any(part.startswith(".") for part in relative.parts):
            continue  # .cache/, .git/: the hub client's bookkeeping, not the model
        if path not in digests:
            digests[path] = _file_digest(path)
        files[_hf_role(relative.name)][relative.as_posix()] = digests[path]
    return files


def is_hf_weights(name: str) -> bool:
    """Whether a file of an hf: model's directory holds its weights (by name)."""
    import fnmatch

    return any(fnmatch.fnmatch(name, pattern) for pattern in HF_WEIGHTS)


def _hf_role(name: str) -> str:
    import fnmatch

    if is_hf_weights(name):
        return "weights"
    if any(fnmatch.fnmatch(name, pattern) for pattern in HF_TOKENIZER):
        return "tokenizer"
    return "code" if name.endswith(".py") else "config"


def _file_digest(path: Path) -> str:
    import blake3

    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:  # an empty file cannot be mapped
        digest.update_mmap(str(path))
    return digest.hexdigest()


# --------------------------------------------------------------------------- weights


def weights_digest(module: torch.nn.Module) -> tuple[str, dict[str, Any], str]:
    """blake3 over every named tensor of the model (name, dtype, shape, bytes).

    Tied tensors (one storage under two names) are hashed once, and the tie is
    recorded (a tied and an untied model export differently).  Returns the
    digest, ``{"tensors": n, "bytes": total}`` and the layout digest (the same
    entries without the bytes: :attr:`Fingerprint.layout`).
    """
    import blake3

    seen: dict[tuple, tuple[str, str]] = {}  # identity -> (digest, first name)
    entries = []
    total = 0
    for name, tensor in named_tensors(module):
        key = _tensor_identity(tensor)
        if key not in seen:
            seen[key] = (tensor_digest(tensor), name)
            total += tensor.numel() * tensor.element_size()
        digest, first = seen[key]
        # Which names share one tensor is part of the program (one input or two).
        entries.append([name, str(tensor.dtype), list(tensor.shape), digest, first if first != name else None])
    digest = blake3.blake3(_canonical(entries)).hexdigest()
    layout = blake3.blake3(_canonical([[n, d, s, tie] for n, d, s, _, tie in entries])).hexdigest()
    return digest, {"tensors": len(entries), "bytes": total}, layout


def named_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """Parameters, buffers (persistent or not) and plain tensor attributes, by qualified name."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in sub._parameters.items():
            if p is not None:
                yield f"{dot}{name}", p
        for name, b in sub._buffers.items():
            if b is not None:
                yield f"{dot}{name}", b
        for name, value in sorted(vars(sub).items()):
            if isinstance(value, torch.Tensor):
                yield f"{dot}{name}", value


def tensor_digest(tensor: torch.Tensor) -> str:
    """blake3 of a tensor's logical bytes (contiguous, row-major), multi-threaded."""
    import blake3

    data = tensor.detach()
    if data.is_sparse or data.layout != torch.strided:
        data = data.to_dense()
    data = data.cpu().contiguous().reshape(-1)
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    raw = data.view(torch.uint8).numpy() if data.numel() else b""
    return blake3.blake3(raw, max_threads=blake3.blake3.AUTO).hexdigest()


def _tensor_identity(t: torch.Tensor) -> tuple:
    if t.layout != torch.strided or t.device.type == "meta":
        return ("unique", id(t))
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


# --------------------------------------------------------------------------- code


def code_digest(module: torch.nn.Module, factory_module: types.ModuleType | None) -> tuple[str, dict[str, Any]]:
    """sha256 over the project source files and distributions the model's code comes from.

    Returns the digest and ``{"files": {label: sha256}, "distributions": {name: version}}``.
    """
    roots: list[types.ModuleType] = []
    for cls in model_classes(module):
        found = sys.modules.get(cls.__module__)
        if found is not None:
            roots.append(found)
    if factory_module is not None:
        roots.append(factory_module)
    files: dict[str, str] = {}
    distributions: dict[str, str] = {}
    for mod in project_modules(roots, distributions):
        path = _source_file(mod)
        files[module_label(mod, factory_module)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    details = {"files": dict(sorted(files.items())), "distributions": dict(sorted(distributions.items()))}
    return _sha256_json(details), details


def model_classes(module: torch.nn.Module) -> list[type]:
    """Every class of the model tree and its bases (``object`` aside), in a stable order."""
    classes: dict[str, type] = {}
    for sub in module.modules():
        for cls in type(sub).__mro__:
            if cls is not object:
                classes.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    return [classes[k] for k in sorted(classes)]


def project_modules(roots: Iterable[types.ModuleType], distributions: dict[str, str]) -> list[types.ModuleType]:
    """The project modules reachable from ``roots`` through their globals, transitively.

    A global that is a module, or an object defined in a module (a function, a
    class, ``from helpers import act``), makes that module reachable.  Modules of
    installed distributions are not followed; their ``name==version`` goes into
    ``distributions`` instead.  Standard-library modules are neither.
    """
    found: dict[str, types.ModuleType] = {}
    stack = list(roots)
    while stack:
        mod = stack.pop()
        name = getattr(mod, "__name__", None)
        if not isinstance(name, str) or name in found:
            continue
        where = classify(mod)
        if where == "stdlib":
            continue
        if where != "project":
            distributions.setdefault(*where)
            continue
        found[name] = mod
        for value in list(vars(mod).values()):
            stack.extend(_modules_of(value))
    return [found[k] for k in sorted(found)]


def _modules_of(value: Any) -> list[types.ModuleType]:
    if isinstance(value, types.ModuleType):
        return [value]
    owner = getattr(value, "__module__", None) if isinstance(value, (type, types.FunctionType)) else None
    if isinstance(owner, str) and owner in sys.modules:
        return [sys.modules[owner]]
    return []


def classify(mod: types.ModuleType) -> str | tuple[str, str]:
    """``"project"``, ``"stdlib"``, or ``(distribution, version)`` for an installed module."""
    path = _source_file(mod)
    if path is None:
        return "stdlib"  # builtins, frozen and extension-only modules of the interpreter
    resolved = str(Path(path).resolve())
    if any(resolved.startswith(p) for p in installed_prefixes()):
        top = mod.__name__.split(".")[0]
        dists = top_level_distributions().get(top)
        if dists:
            dist = sorted(dists)[0]
            version = _distribution_version(dist)
            if version is not None:
                return dist, version
        return (f"module:{top}", "unknown")
    if any(resolved.startswith(p) for p in _stdlib_prefixes()):
        return "stdlib"
    return "project"


def module_label(mod: types.ModuleType, factory_module: types.ModuleType | None) -> str:
    """A machine-independent label: the module name, or ``<factory>/<file>`` for a factory loaded by path."""
    if factory_module is not None and mod is factory_module and mod.__name__.startswith("lowerflow_model_"):
        return f"<factory>/{Path(_source_file(mod)).name}"
    return mod.__name__


def _source_file(mod: types.ModuleType) -> str | None:
    path = getattr(mod, "__file__", None)
    if not path or not path.endswith(".py"):
        spec = getattr(mod, "__spec__", None)
        path = getattr(spec, "origin", None) if spec is not None else path
    if not path or not path.endswith(".py") or not Path(path).is_file():
        return None
    return path


@functools.lru_cache(maxsize=None)
def _distribution_version(dist: str) -> str | None:
    """An installed distribution's version, read once per process (parsing its
    METADATA costs ~5 ms; the code a process has imported does not change version)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def installed_prefixes() -> tuple[str, ...]:
    """The site-packages directories (each ending in ``/``): where installed distributions live."""
    paths = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    for entry in sys.path:  # other site-packages on the path (user site, venv overlays)
        if entry.rstrip("/").endswith(("site-packages", "dist-packages")):
            paths.add(entry)
    return tuple(str(Path(p).resolve()) + "/" for p in paths if p)


@functools.lru_cache(maxsize=1)
def _stdlib_prefixes() -> tuple[str, ...]:
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}
    return tuple(str(Path(p).resolve()) + "/" for p in paths if p)


@functools.lru_cache(maxsize=1)
def top_level_distributions() -> Mapping[str, list[str]]:
    """The distributions of each top-level module name (read once per process)."""
    return importlib.metadata.packages_distributions()


# --------------------------------------------------------------------------- attributes


#: nn.Module bookkeeping that says nothing about what the model computes.
_MODULE_INTERNALS = frozenset({"training", "_parameters", "_buffers", "_modules"})


def attributes_document(module: torch.nn.Module) -> list[Any]:
    """Per submodule: its name, class and plain attributes (tensors are weights, not here)."""
    doc = []
    for name, sub in module.named_modules(remove_duplicate=False):
        attrs = {
            key: _plain(value)
            for key, value in sorted(vars(sub).items())
            if not key.startswith("_") and key not in _MODULE_INTERNALS
            and not isinstance(value, (torch.Tensor, torch.nn.Module))
        }
        cls = type(sub)
        doc.append([name, f"{cls.__module__}.{cls.__qualname__}", bool(sub.training), attrs])
    return doc


def _plain(value: Any, depth: int = 0) -> Any:
    """JSON data for an attribute value; objects without a plain form are their type's name.

    Never an ``id()`` or memory address, so equal models give equal documents in
    any process.
    """
    if depth > 8:
        return "<deep>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v, depth + 1) for v in value), key=repr)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    if isinstance(value, functools.partial):
        return {"partial": _plain(value.func, depth + 1), "args": _plain(value.args, depth + 1),
                "keywords": _plain(value.keywords, depth + 1)}
    if dataclasses.is_dataclass(value):
        return {"dataclass": type(value).__qualname__,
                "fields": {f.name: _plain(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}}
    to_dict = getattr(value, "to_dict", None)  # e.g. transformers' PretrainedConfig
    if callable(to_dict):
        try:
            return {"object": type(value).__qualname__, "dict": _plain(to_dict(), depth + 1)}
        except Exception:
            pass
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


# --------------------------------------------------------------------------- inputs


def inputs_document(inputs: Any, dynamic_shapes: Any = None) -> dict[str, Any]:
    """The inputs' tree structure and, per leaf, dtype, shape and a digest of the values;
    the dynamic shapes (JSON form) when there are any."""
    leaves, spec = pytree.tree_flatten(inputs)
    doc = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            doc.append({"dtype": str(leaf.dtype), "shape": list(leaf.shape), "values": tensor_digest(leaf)})
        else:
            doc.append({"value": _plain(leaf)})
    document = {"structure": str(spec), "leaves": doc}
    if dynamic_shapes is not None:
        document["dynamic_shapes"] = dynamic_shapes
    return document


# --------------------------------------------------------------------------- hashing


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(_canonical(obj)).hexdigest()
