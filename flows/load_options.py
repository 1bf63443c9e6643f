"""The options a model is loaded and exported with: part of its fingerprint, and what a
stage retried in another process loads it with again::

    export_options("2", None, load_extras(strict=True, hf={"task": "fill-mask"}))
        == {"version": "2", "strict": True, "hf": {"task": "fill-mask"}}
"""

from __future__ import annotations

from typing import Any


def load_extras(strict: bool = False, hf: dict[str, Any] | None = None, trust_pickle: bool = False) -> dict[str, Any]:
    """The load options beyond version and dynamic shapes: ``strict`` and ``trust_pickle``
    (each when set) and an hf: model's task and options (its None values left out)."""
    extras: dict[str, Any] = {}
    if strict:
        extras["strict"] = True
    if trust_pickle:
        extras["trust_pickle"] = True
    hf = {k: v for k, v in (hf or {}).items() if v is not None}
    if hf:
        extras["hf"] = hf
    return extras


def export_options(version: str | None, dynamic_shapes: Any = None, extras: dict | None = None) -> dict[str, Any]:
    """The options the model is loaded and exported with (part of its fingerprint);
    ``dynamic_shapes`` and the :func:`load_extras` only when given, so other models keep their keys."""
    options: dict[str, Any] = {"version": version}
    if dynamic_shapes is not None:
        options["dynamic_shapes"] = dynamic_shapes
    options.update(extras or {})
    return options


def add_load_arguments(parser: Any) -> None:
    """``lowerflow lower``'s ``--strict``, ``--trust-pickle`` and an hf: model's ``--task``,
    ``--max-seq-len``, ``--dtype``, ``--attn``."""
    parser.add_argument("--strict", action="store_true", help="export with torch.export's strict mode (TorchDynamo)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="a .pt2 or pytorch_model.bin you trust: load its pickles, which may run code "
                             "(by default lowerflow refuses them; see docs/security.md)")
    parser.add_argument("--task", metavar="TASK",
                        help="an hf: model's task: text-generation, feature-extraction, fill-mask, "
                             "image-classification or automatic-speech-recognition")
    parser.add_argument("--max-seq-len", type=int, metavar="N",
                        help="an hf: model's KV cache length / longest input (default: the config's, at most 2048)")
    parser.add_argument("--dtype", metavar="DTYPE", help="an hf: model's dtype: float32 (default), float16, bfloat16")
    parser.add_argument("--attn", metavar="ATTN", help="the decoder's attention (text-generation, automatic-speech-"
                        "recognition): custom (llama ops, the default) or standard (aten SDPA)")
    parser.add_argument("--last-token-logits", action="store_const", const=True, default=None,
                        help="text-generation: forward returns the last position's logits [1, V] only")


def load_arguments(args: Any, spec: str) -> dict[str, Any]:
    """``lower_model``'s ``strict`` / ``trust_pickle`` / ``hf`` parameters from the command line (only when
    given); ValueError when an hf: option is given for another kind of model."""
    hf = {key: getattr(args, key) for key in ("task", "max_seq_len", "dtype", "attn", "last_token_logits")
          if getattr(args, key, None) is not None}
    if hf and not spec.strip().startswith("hf:"):
        flags = ", ".join("--" + key.replace("_", "-") for key in hf)
        raise ValueError(f"{flags}: only for an hf: model, not {spec!r}")
    return {**({"strict": True} if getattr(args, "strict", False) else {}),
            **({"trust_pickle": True} if getattr(args, "trust_pickle", False) else {}),
            **({"hf": hf} if hf else {})}
