"""Finding and loading a Hugging Face model: ``transformers`` (an optional extra),
the model's directory (local, or a hub id downloaded by ``huggingface_hub``),
its config and dtype.

    "./my-model"           ─► Path("./my-model")          (a save_pretrained directory)
    "HuggingFaceTB/SmolLM2-135M" ─► the hub snapshot's directory (network)
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import torch

from ..errors import LoweringError

#: How to get transformers: the product's optional extra.
INSTALL_HINT = "pip install 'lowerflow[hf]'"

#: dtype option -> torch dtype.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class HFError(LoweringError):
    """A Hugging Face model that cannot be loaded or wrapped for its task; the message names it."""


def require_transformers(source: str) -> Any:
    """The ``transformers`` module, or HFError saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise HFError(f"hf:{source}: needs the 'transformers' package: {INSTALL_HINT}") from None
    return transformers


def check_transformers(source: str) -> None:
    """HFError saying how to install ``transformers`` unless it is installed (not imported:
    a cached run that describes the model from its memo never imports it)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise HFError(f"hf:{source}: needs the 'transformers' package: {INSTALL_HINT}")


def transformers_version() -> str:
    """``transformers``' version (part of an hf model's fingerprint), "" without it: its
    distribution's, which is its ``__version__``, read without importing it."""
    import importlib.metadata

    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return ""


def is_local(source: str) -> bool:
    """Whether ``source`` names a local directory (else it is a hub id)."""
    return Path(source).expanduser().is_dir()


def check_source(source: str) -> None:
    """HFError unless ``source`` is a directory with a ``config.json`` or looks like a hub id."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise HFError(f"hf:{source}: {str(path)!r} has no config.json (a save_pretrained directory has one)")
        return
    if source.startswith((".", "/", "~")) or not _HUB_ID.match(source):
        raise HFError(f"hf:{source}: no such directory (and not a hub model id such as 'org/name')")


def model_directory(source: str) -> Path:
    """The local directory of ``source``: itself, or the hub snapshot (downloaded)."""
    check_source(source)
    if is_local(source):
        return Path(source).expanduser().resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source))
    except Exception as exc:
        raise HFError(f"hf:{source}: not a local directory, and the hub download failed: "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc


def torch_dtype(source: str, dtype: str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if dtype not in DTYPES:
        raise HFError(f"hf:{source}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[dtype]


#: Serializes :func:`from_pretrained` within a process (see there).
_LOAD_LOCK = threading.Lock()


#: What a refused checkpoint says after its reason.
CHECKPOINT_RULE = "lowerflow loads checkpoints without running code"
#: transformers' names of a pickle checkpoint, and of safetensors ones (which it prefers).
PICKLE_WEIGHTS, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def pickle_checkpoints(directory: Path) -> list[str]:
    """The pickle files ``from_pretrained`` reads from ``directory``: ``pytorch_model.bin``
    or its shards, when there are no safetensors weights (which it would read instead)."""
    if any((directory / name).is_file() for name in SAFE_WEIGHTS):
        return []
    if (directory / PICKLE_INDEX).is_file():
        import json

        try:
            shards = (json.loads((directory / PICKLE_INDEX).read_text()).get("weight_map") or {}).values()
        except (ValueError, AttributeError):
            return [PICKLE_INDEX]
        return sorted({str(shard) for shard in shards})
    return [PICKLE_WEIGHTS] if (directory / PICKLE_WEIGHTS).is_file() else []


def check_checkpoint(source: str, directory: Path) -> None:
    """UntrustedInputError naming the file unless each pickle checkpoint of ``directory``
    loads with ``torch.load(weights_only=True)`` (tensors only: it never runs code).  Read
    on the meta device: the pickle, not the weights' bytes."""
    from ..errors import UntrustedInputError

    for name in pickle_checkpoints(directory):
        path = (directory / name).resolve()
        if directory.resolve() not in path.parents:
            raise UntrustedInputError.of(f"hf:{source}", f"{PICKLE_INDEX} names {name!r}, outside the model's "
                                         "directory", CHECKPOINT_RULE)
        try:
            torch.load(path, map_location="meta", weights_only=True)
        except Exception:
            raise UntrustedInputError.of(f"hf:{source}", f"{name} is a pickle of more than tensors",
                                         CHECKPOINT_RULE) from None


def from_pretrained(source: str, directory: Path, auto_class: str, dtype: torch.dtype, *,
                    trust_pickle: bool = False, **kwargs: Any):
    """``transformers.<auto_class>.from_pretrained(directory)`` in eval mode; HFError naming
    the source and the class on failure (e.g. a config the task's Auto class does not take).

    Never the checkpoint's code: ``trust_remote_code=False`` (a config that needs its own
    ``*.py`` fails), and a ``pytorch_model.bin`` loads with ``weights_only=True`` after
    :func:`check_checkpoint`, unless ``trust_pickle``."""
    transformers = require_transformers(source)
    if not trust_pickle:
        check_checkpoint(source, directory)
    kwargs = {**kwargs, "trust_remote_code": False, "weights_only": not trust_pickle}
    try:
        # Weights the checkpoint lacks (a head the task adds) are initialized from a fixed
        # seed: the same directory gives the same model, and the same .pte, in any process.
        # One load at a time: from_pretrained switches process-wide state (default dtype,
        # weight-init flags, the RNG seeded here) while it runs.  So does torch.export: a
        # caller on threads must not load beside an export either (tasks.torch_lock).
        with _LOAD_LOCK, torch.random.fork_rng():
            torch.manual_seed(0)
            model = getattr(transformers, auto_class).from_pretrained(str(directory), dtype=dtype, **kwargs)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise HFError(f"hf:{source}: {auto_class}.from_pretrained failed: {type(exc).__name__}: "
                      f"{text[0] if text else ''}") from exc
    # Inference only: a cache buffer updated in place from weights that require grad would
    # become a non-leaf tensor (it cannot be deep-copied, and export warns about it).
    return model.eval().requires_grad_(False)


#: The tasks whose models generate (their ``generation_config`` holds token ids the
#: constant methods read).
_GENERATIVE = ("text-generation", "automatic-speech-recognition")


def config_only(source: str, directory: Path, task: str) -> Any:
    """A stand-in for the loaded model of ``directory`` with only what describing its
    program reads: ``config`` (``AutoConfig``) and ``generation_config`` (the directory's
    ``generation_config.json``, else derived from the config, as ``from_pretrained``
    does for a model that generates; None for one that does not).  No weights are read."""
    import types

    transformers = require_transformers(source)
    try:
        config = transformers.AutoConfig.from_pretrained(str(directory))
        generation = None
        if task in _GENERATIVE:
            if (directory / "generation_config.json").is_file():
                generation = transformers.GenerationConfig.from_pretrained(str(directory))
            else:
                generation = transformers.GenerationConfig.from_model_config(config)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        raise HFError(f"hf:{source}: cannot read its config: {type(exc).__name__}: {text[0] if text else ''}") from exc
    return types.SimpleNamespace(config=config, generation_config=generation)
