"""``hf:`` model specs: a Hugging Face model directory (or hub id) with a task.

``hf:./my-model`` names the model; its task and options come with it from the
CLI (``--task``, ``--max-seq-len``, ``--dtype``, ``--attn``) or the manifest
entry (``task:``, ``max_seq_len:``, ...), and travel in the load options as
``{"hf": {"task": ..., "max_seq_len": ...}}`` (so a stage retried in another
process loads the same model).  :func:`load` wraps the model for its task
(:func:`lowering.hf.load_hf`: the methods of one program and its constant
methods) and fingerprints its directory (:func:`tasks.fingerprint.fingerprint_hf`:
weights, tokenizer, config, transformers' version, options), each method by the
same parts plus its name::

    hf:./tiny-llama + {"task": "text-generation", "max_seq_len": 64}
        ─► methods {"forward": (decoder, (ids, pos), dims)},
           constants {"get_max_seq_len": 64, ...}, fingerprints {"forward": ...}, the model's

Errors are :class:`lowering.hf.HFError` naming ``hf:<source>``; the caller
(:mod:`tasks.model_spec`) makes them ModelSpecErrors.
"""

from __future__ import annotations

from typing import Any, Mapping

from .fingerprint import fingerprint_hf

#: The prefix of an hf: spec.
PREFIX = "hf:"


def hf_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The hf: part of the load options: ``{"task": ..., "max_seq_len": ..., ...}``."""
    return dict((options or {}).get("hf") or {})


def trust_pickle(options: Mapping[str, Any] | None) -> bool:
    """The load options' ``trust_pickle`` (a pickle checkpoint may unpickle more than tensors)."""
    return bool((options or {}).get("trust_pickle"))


def check(source: str, options: Mapping[str, Any] | None) -> None:
    """HFError unless the source can be found and the task and options are valid (nothing loads);
    UntrustedInputError if a local directory's pickle checkpoint is more than tensors."""
    from lowering.hf import check_options
    from lowering.hf.loading import check_source, require_transformers

    from pathlib import Path

    from lowering.hf.loading import check_checkpoint, is_local

    hf = hf_options(options)
    task = hf.pop("task", None)
    check_options(source, task, hf)
    require_transformers(source)
    check_source(source)
    if is_local(source) and not trust_pickle(options):
        check_checkpoint(source, Path(source).expanduser())


def load(source: str, options: Mapping[str, Any] | None):
    """``(HFProgram, {method: Fingerprint}, the model's Fingerprint)``."""
    from lowering.hf import load_hf, transformers_version

    hf = hf_options(options)
    task = hf.pop("task", None)
    program = load_hf(source, task, **hf, trust_pickle=trust_pickle(options))
    keyed = {**{k: v for k, v in (options or {}).items() if k != "hf"}, "hf": program.options}
    version = transformers_version()
    methods = {name: fingerprint_hf(program.directory, keyed, version, method=name) for name in program.methods}
    whole = fingerprint_hf(program.directory, {**keyed, "constants": program.constants}, version)
    return program, methods, whole

