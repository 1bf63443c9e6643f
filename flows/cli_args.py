"""The ``lowerflow`` command line's arguments checked before any work: the model spec, dynamic
shapes, quantize options, runtime-op sets, targets and gates.  A bad one is a :class:`CLIError` with
exit status 2 (:data:`EXIT_USAGE`), one line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

from .console import first_line
from .load_options import load_arguments

#: Exit codes.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A failure to report as one line; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def parse_spec(text: str, args: argparse.Namespace | None = None):
    """The ModelSpec of ``text``, checked (hf: with ``args``' task, options; a .pt2 read
    without running code unless ``--trust-pickle``); a bad one is exit status 2."""
    from tasks.model_spec import ModelSpec, check_pt2, check_spec, read_pt2

    try:
        spec = ModelSpec.parse(text)
        options = load_arguments(args, text) if args is not None else None
        if spec.kind != "pt2":
            check_spec(spec, options=options)
        elif not (options or {}).get("trust_pickle") and Path(spec.location).is_file():
            check_pt2(spec, read_pt2(spec))
        return spec
    except ValueError as exc:  # ModelSpecError, or an hf: option for another kind of model
        raise CLIError(str(exc), EXIT_USAGE) from exc


def parse_dynamic_shapes(text: str | None, spec) -> Any:
    """``--dynamic-shapes JSON`` validated and canonical; a bad one is exit status 2."""
    from flows.manifest import ManifestError, dynamic_shapes_option

    try:
        return dynamic_shapes_option(text, spec)
    except ManifestError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from None


def parse_quantize(args: argparse.Namespace, targets: list[str]) -> dict[str, Any]:
    """``--quantize`` / ``--calibration`` / ``--min-sqnr`` / ``--max-error`` as lower_model
    parameters (:func:`flows.quantized.quantize_options`); bad ones are exit status 2."""
    from flows.quantized import quantize_options

    try:
        return quantize_options(args.quantize, args.calibration, args.min_sqnr, args.max_error, targets,
                                getattr(args, "qembedding", None))
    except ValueError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from None


def parse_runtime_ops(text: str | None, targets: list[str]) -> dict[str, Any]:
    """``--runtime-ops portable,quantized`` as lower_model's ``runtime_ops``; a bad set name is exit status 2."""
    from flows.manifest import ManifestError, profiles_by_target

    try:
        return {} if text is None else {"runtime_ops": profiles_by_target(text, targets, "--runtime-ops")}
    except ManifestError as exc:
        raise CLIError(str(exc), EXIT_USAGE) from None


def parse_targets(texts: Sequence[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """``-t xnnpack -t android=vulkan,xnnpack`` as (target names, lower_model's ``options``):
    ``["xnnpack", "android"]``, ``{"android": {"backends": ["vulkan", "xnnpack"]}}`` (a chain:
    lowering.targets.chain_of).  A name given twice is exit status 2."""
    targets, options = [], {}
    for text in texts:
        name, chain, backends = text.partition("=")
        if chain:
            if not name or not backends:
                raise CLIError(f"--target {text!r}: a chain is NAME=BACKEND,BACKEND,... "
                               "(e.g. android=vulkan,xnnpack)", EXIT_USAGE)
            options[name] = {"backends": [b.strip() for b in backends.split(",") if b.strip()]}
        targets.append(name)
    if len(set(targets)) != len(targets):
        raise CLIError(f"--target lists a target twice: {targets}", EXIT_USAGE)
    return targets, options


def check_targets(targets: Sequence[str], options: dict[str, dict[str, Any]] | None = None) -> None:
    """Every target names ``portable``, a backend that can lower here, or a chain of them
    (``options``); otherwise exit status 2 (one line: e.g. the extra to install)."""
    from lowering.errors import BackendError
    from lowering.targets import check_target

    for target in targets:
        try:
            check_target(target, (options or {}).get(target))
        except BackendError as exc:
            raise CLIError(f"--target: {first_line(str(exc))}", EXIT_USAGE) from exc


def add_gate_arguments(parser: argparse.ArgumentParser, one_model: bool) -> None:
    """``--accept-regressions``; for one model also ``--gates JSON`` and ``--no-benchmark`` (flows/gates.py)."""
    parser.add_argument("--accept-regressions", action="store_true",
                        help="publish a program even when a gate refuses it (worse than the published one); "
                             "its record says so")
    if one_model:
        parser.add_argument("--gates", metavar="JSON", help="the largest changes allowed against the published "
                            "program, e.g. '{\"latency\": 1.10, \"size\": 1.05, \"error\": 1.5, "
                            "\"sqnr_drop_db\": 1.0}'")
        parser.add_argument("--no-benchmark", action="store_true",
                            help="do not time the program on ExecuTorch's runtime (the benchmark stage)")


def gate_arguments(args: argparse.Namespace, targets: list[str]) -> dict[str, Any]:
    """``lower_model``'s ``gates`` / ``benchmark`` / ``accept_regressions`` from the command line
    (only when given); a bad ``--gates`` is exit 2."""
    import json

    from flows.gates import gates_by_target

    out: dict[str, Any] = {}
    if getattr(args, "gates", None):
        try:
            out["gates"] = gates_by_target(json.loads(args.gates), targets, "--gates")
        except ValueError as exc:  # json.JSONDecodeError is one
            raise CLIError(f"--gates {args.gates!r}: {exc}", EXIT_USAGE) from None
    if getattr(args, "no_benchmark", False):
        out["benchmark"] = False
    if args.accept_regressions:
        out["accept_regressions"] = True
    return out
