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
    from lowering.hf.loading import check_source, check_transformers

    from pathlib import Path

    from lowering.hf.loading import check_checkpoint, is_local

    hf = hf_options(options)
    task = hf.pop("task", None)
    check_options(source, task, hf)
    check_transformers(source)
    check_source(source)
    if is_local(source) and not trust_pickle(options):
        check_checkpoint(source, Path(source).expanduser())


def load(source: str, options: Mapping[str, Any] | None):
    """``(HFProgram, {method: Fingerprint}, the model's Fingerprint)``: the model loaded."""
    from lowering.hf import load_hf

    hf = hf_options(options)
    task = hf.pop("task", None)
    program = load_hf(source, task, **hf, trust_pickle=trust_pickle(options))
    return (program, *fingerprints(program.directory, list(program.methods), program.constants, program.options,
                                   options))


def describe(source: str, options: Mapping[str, Any] | None, memo=None):
    """``(HFDescription, {method: Fingerprint}, the model's Fingerprint)``: what :func:`load`
    fingerprints, from the model's files and config alone (nothing is loaded): a cached
    run needs no more.  ``memo``: an :class:`~tasks.store.ArtifactStore` that remembers
    descriptions (:func:`description_key`), so a rerun on the same config files, options,
    transformers and lowerflow describes the model without importing transformers."""
    from lowering.hf import HFDescription, check_options, describe_hf
    from lowering.hf.loading import check_source, check_transformers, model_directory

    from .fingerprint import hf_files

    hf = hf_options(options)
    task = hf.pop("task", None)
    check_options(source, task, hf)
    check_transformers(source)
    check_source(source)
    directory, digests = model_directory(source), {}
    key = description_key(hf_files(directory, digests), task, hf) if memo is not None else None
    remembered = _recall(memo, key)
    if remembered is not None:
        described = HFDescription(source, directory, task, tuple(remembered["method_names"]),
                                  remembered["constants"], remembered["options"], remembered["share_mutable_buffers"])
    else:
        described = describe_hf(source, task, **hf)
        _remember(memo, key, described)
    return (described, *fingerprints(described.directory, list(described.method_names), described.constants,
                                     described.options, options, digests))


#: Bumped when a remembered description changes shape.
DESCRIPTION_FORMAT = 1


def description_key(files: dict[str, dict[str, str]], task: str | None, hf: Mapping[str, Any]) -> str:
    """The memo key of an hf: model's description: everything that decides it, which is
    the directory's config and code files (by digest: ``config.json``,
    ``generation_config.json``, ...; never the weights), the task and options as given,
    transformers' version (its config classes) and lowerflow's own source (the describing
    code: :func:`tasks.cache_keys.source_digest`)."""
    import hashlib
    import json

    from lowering.hf import transformers_version

    from .cache_keys import environment_versions

    document = {"format": DESCRIPTION_FORMAT, "config": files["config"], "code": files["code"], "task": task,
                "options": dict(hf), "transformers": transformers_version(),
                "lowerflow_source": environment_versions()["lowerflow_source"]}
    return "hf-description-" + hashlib.sha256(json.dumps(document, sort_keys=True).encode("utf-8")).hexdigest()


def _recall(memo, key: str | None) -> dict | None:
    if memo is None:
        return None
    try:
        return memo.get_memo(key)
    except Exception:  # an unreachable store: describe from the config (the stages will say why)
        return None


def _remember(memo, key: str | None, described) -> None:
    """Remember ``described`` unless its JSON form would not be the same description."""
    import json

    if memo is None:
        return
    value = {"method_names": list(described.method_names), "constants": described.constants,
             "options": described.options, "share_mutable_buffers": described.share_mutable_buffers}
    try:
        if json.loads(json.dumps(value)) != value:
            return
        memo.put_memo(key, value)
    except Exception:  # not JSON, or a read-only / unreachable store: no memo
        return


def fingerprints(directory, methods: list[str], constants: dict, resolved: dict, options: Mapping[str, Any] | None,
                 digests: dict | None = None):
    """({method: Fingerprint}, the model's Fingerprint) of an hf: model's ``directory``:
    its files, the load ``options`` with their hf: part ``resolved`` (defaults filled in),
    transformers' version; the whole model's also covers its ``constants``.  ``digests``:
    the files' digests already taken (:func:`tasks.fingerprint.fingerprint_hf`)."""
    from lowering.hf import transformers_version

    keyed = {**{k: v for k, v in (options or {}).items() if k != "hf"}, "hf": resolved}
    version, digests = transformers_version(), ({} if digests is None else digests)
    methods_fp = {name: fingerprint_hf(directory, keyed, version, method=name, digests=digests) for name in methods}
    whole = fingerprint_hf(directory, {**keyed, "constants": constants}, version, digests=digests)
    return methods_fp, whole
