"""Reading a ``.pt2`` (and torch's JSON program) without running the code it may carry.

A ``.pt2`` is data, yet ``torch.export.load`` (torch 2.13) runs code for some of it:

=========================================  ==============================================
in the archive                              what torch.export.load does with it
=========================================  ==============================================
weight / constant marked ``use_pickle``     ``torch.load`` with ``weights_only=False``
constant ``opaque_obj_*``                   ``pickle.loads``
constant ``custom_obj_*``                   ``torch._C._pickle_load_obj`` (TorchScript)
sample inputs, legacy ``data/*/<m>.pt``     ``torch.load(weights_only=True)``, and on failure
                                            **again with** ``weights_only=False``
``data/aotinductor/``                       loads the shared libraries in it
a symbolic size (``expr_str``)              ``sympy.sympify``: Python's ``eval``
an archive of torch < 2.7 (no format)       the steps above, through ``zipfile``
=========================================  ==============================================

:func:`check_pt2` reads the archive through torch's own reader (the bytes the load then
reads) and, before anything unpickles, refuses whatever would run code, in one line
naming the file and the entry::

    model.pt2: weight 'weight' is a pickle; lowerflow loads .pt2 files without running
    code (trust_pickle: true on the entry, or --trust-pickle, loads it anyway)

What it lets through: raw tensor payloads, the JSON program (every ``expr_str`` a plain
sympy expression: :func:`check_sym_expr`), sample inputs and legacy state dicts that
``torch.load(weights_only=True)`` reads (it never runs code), ``extra/`` strings.
:func:`load_pt2` then loads with torch's loader of the archive format (no fallback to
the pre-2.7 reader) while ``torch.load`` in this thread is forced to
``weights_only=True``: a path torch adds later that unpickles fails instead of running
code.  With ``trust_pickle`` it is ``torch.export.load`` as it is.

A node whose target is not an operator (``torch.os.system``) never gets this far:
torch's verifier refuses it while the program deserializes.  The store's programs
(:mod:`lowering.serialize`) go through :func:`check_program_json` too.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
import tokenize
from typing import Any, Iterator

import torch
from torch.export import ExportedProgram

from .errors import LoweringError, UntrustedInputError, first_line

#: What a refused .pt2 says after its reason.
PT2_RULE = "lowerflow loads .pt2 files without running code"

# The archive layout (torch/csrc/export/pt2_archive_constants.h; torch.export.pt2_archive.constants).
_FORMAT, _FORMAT_VALUE = "archive_format", "pt2"
_MODELS, _WEIGHTS, _CONSTANTS, _SAMPLES, _EXTRA = "models/", "data/weights/", "data/constants/", "data/sample_inputs/", "extra/"
_AOTI = "data/aotinductor/"
_TENSOR, _CUSTOM_OBJ, _OPAQUE_OBJ = "tensor_", "custom_obj_", "opaque_obj_"
#: Entries a torch.export.save archive has besides its programs and data.
_BOOKKEEPING = ("archive_format", "archive_version", "byteorder", ".data/")


class Pt2Error(LoweringError):
    """A ``.pt2`` that cannot be read at all (not a zip archive torch can open)."""


# --------------------------------------------------------------------------- .pt2


def check_pt2(data: bytes, label: str) -> None:
    """Raise :class:`UntrustedInputError` (naming ``label`` and the entry) unless the archive
    loads without running code; :class:`Pt2Error` if it cannot be read (not an archive,
    a missing or malformed entry)."""
    try:
        _check_archive(data, label)
    except (UntrustedInputError, Pt2Error):
        raise
    except Exception as exc:
        raise Pt2Error(f"{label}: cannot read the archive: {type(exc).__name__}: {first_line(exc)}") from None


def _check_archive(data: bytes, label: str) -> None:
    reader = _reader(data, label)
    names = reader.get_all_records()
    if _FORMAT not in names or reader.get_record(_FORMAT).decode(errors="replace") != _FORMAT_VALUE:
        _refuse(label, "not an archive of torch.export.save (torch >= 2.7: no archive_format 'pt2'); "
                       "older archives load through pickle")
    for name in names:
        _check_entry(label, name)
    models = sorted(n[len(_MODELS):-len(".json")] for n in names if n.startswith(_MODELS) and n.endswith(".json"))
    if not models:
        _refuse(label, "the archive holds no program (models/*.json)")
    for model in models:
        _check_model(reader, names, label, model)


def load_pt2(data: bytes, label: str, *, trust_pickle: bool = False) -> ExportedProgram:
    """The program ``model`` of a ``.pt2``: checked (:func:`check_pt2`) and loaded with
    ``torch.load`` forced to ``weights_only=True``; ``trust_pickle``: ``torch.export.load``."""
    if trust_pickle:
        return torch.export.load(io.BytesIO(data))
    check_pt2(data, label)
    from torch.export.pt2_archive._package import load_pt2 as torch_load_pt2

    with weights_only():
        contents = torch_load_pt2(io.BytesIO(data))
    if "model" not in contents.exported_programs:
        raise Pt2Error(f"{label}: the archive has no program named 'model' "
                       f"(it has {sorted(contents.exported_programs)})")
    return contents.exported_programs["model"]


def _reader(data: bytes, label: str) -> Any:
    try:
        return torch._C.PyTorchFileReader(io.BytesIO(data))
    except Exception as exc:
        raise Pt2Error(f"{label}: not a .pt2 archive: {first_line(exc)}") from None


def _check_entry(label: str, name: str) -> None:
    """Refuse an entry torch.export.save does not write: compiled code, or unknown."""
    if name.startswith(_AOTI):
        _refuse(label, f"entry {name!r} is compiled code (AOTInductor), which loading would run")
    known = (_MODELS, _WEIGHTS, _CONSTANTS, _SAMPLES, _EXTRA)
    if not (name.startswith(known) or name.startswith(_BOOKKEEPING)):
        _refuse(label, f"entry {name!r} is not part of a torch.export.save archive")
    if name.startswith(_MODELS) and not name.endswith(".json"):  # torch would read it as a program
        _refuse(label, f"entry {name!r} is not a program (models/<name>.json)")


def _check_model(reader: Any, names: list[str], label: str, model: str) -> None:
    """One program's JSON, weights, constants and sample inputs."""
    check_program_bytes(reader.get_record(f"{_MODELS}{model}.json"), label)
    legacy_weights, legacy_constants = f"{_WEIGHTS}{model}.pt", f"{_CONSTANTS}{model}.pt"
    if legacy_weights in names:
        _probe(reader, legacy_weights, label, "legacy weights", dict)
    else:
        _check_payloads(reader, names, label, f"{_WEIGHTS}{model}_weights_config.json", "weight")
    if legacy_constants in names:
        _probe(reader, legacy_constants, label, "legacy constants", dict)
    else:
        _check_payloads(reader, names, label, f"{_CONSTANTS}{model}_constants_config.json", "constant")
    samples = f"{_SAMPLES}{model}.pt"
    if samples in names:
        _probe(reader, samples, label, "sample inputs", (tuple, dict))


def _check_payloads(reader: Any, names: list[str], label: str, config: str, kind: str) -> None:
    """Every weight / constant of a payload config is a raw tensor (never a pickle)."""
    if config not in names:
        return  # torch's loader says the config is missing
    try:
        entries = json.loads(reader.get_record(config)).get("config") or {}
    except (ValueError, AttributeError) as exc:
        raise Pt2Error(f"{label}: {config} is not a payload config: {first_line(exc)}") from None
    for fqn, meta in entries.items():
        meta = meta if isinstance(meta, dict) else {}
        path = str(meta.get("path_name", ""))
        if kind == "constant" and path.startswith(_OPAQUE_OBJ):
            _refuse(label, f"constant {fqn!r} is a pickled Python object ({path})")
        if kind == "constant" and path.startswith(_CUSTOM_OBJ):
            _refuse(label, f"constant {fqn!r} is a TorchScript object ({path}), a pickle")
        if meta.get("use_pickle"):  # as torch reads it: ``if payload_meta.use_pickle``
            _refuse(label, f"{kind} {fqn!r} is a pickle")
        if kind == "constant" and not path.startswith(_TENSOR):
            _refuse(label, f"constant {fqn!r} has a payload torch may not read as raw bytes ({path!r})")


def _probe(reader: Any, name: str, label: str, what: str, types: Any) -> None:
    """``name`` must load with ``torch.load(weights_only=True)`` (which never runs code) as
    ``types``: torch's loader would retry a failure with ``weights_only=False``."""
    try:
        value = torch.load(io.BytesIO(reader.get_record(name)), weights_only=True, map_location="cpu")
    except Exception:
        _refuse(label, f"entry {name!r} ({what}) is a pickle of more than tensors")
    if not isinstance(value, types):
        _refuse(label, f"entry {name!r} ({what}) is a pickle of a {type(value).__name__}")


def _refuse(label: str, why: str) -> None:
    raise UntrustedInputError.of(label, why, PT2_RULE)


# --------------------------------------------------------------------------- weights_only


_GUARD = threading.RLock()
_LOCAL = threading.local()


@contextlib.contextmanager
def weights_only() -> Iterator[None]:
    """In this thread, for the block, every ``torch.load`` is ``weights_only=True`` (other
    threads' calls are left as they are).  One guarded thread at a time."""
    with _GUARD:
        real = torch.load
        depth = getattr(_LOCAL, "depth", 0)

        def load(*args: Any, **kwargs: Any) -> Any:
            if getattr(_LOCAL, "depth", 0):
                kwargs["weights_only"] = True
            return real(*args, **kwargs)

        torch.load, _LOCAL.depth = load, depth + 1
        try:
            yield
        finally:
            torch.load, _LOCAL.depth = real, depth


# --------------------------------------------------------------------------- symbolic sizes


#: Names a symbolic size of torch's serializer (``sympy.srepr``, or ``str`` in older
#: archives) may call: sympy's number, arithmetic, relational and logic classes, and
#: torch's own sympy functions (``torch.utils._sympy.functions``).
SYMPY_NAMES = frozenset({
    "Symbol", "Dummy", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs",
    "floor", "ceiling", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan",
    "LessThan", "StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "Xor", "ITE", "Piecewise",
    "ExprCondPair", "true", "false", "BooleanTrue", "BooleanFalse", "oo", "zoo", "nan", "Infinity",
    "NegativeInfinity", "NegativeOne", "One", "Zero", "Half", "True", "False", "None",
    # torch.utils._sympy.functions
    "MinMaxBase", "OpaqueUnaryFn_acos", "OpaqueUnaryFn_asin", "OpaqueUnaryFn_asinh", "OpaqueUnaryFn_atan",
    "OpaqueUnaryFn_cos", "OpaqueUnaryFn_cosh", "OpaqueUnaryFn_log2", "OpaqueUnaryFn_sin", "OpaqueUnaryFn_sinh",
    "OpaqueUnaryFn_tan", "OpaqueUnaryFn_tanh", "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv",
    "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
    "ToFloat", "Identity", "OpaqueUnaryFn_sqrt", "OpaqueUnaryFn_exp", "OpaqueUnaryFn_log",
    "BitwiseFn_bitwise_and", "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor",
})
#: A bare symbol of torch's shape environment (``s0``, ``u3``, ``zuf1``).
_SYMBOL = re.compile(r"^[a-z]+[0-9]+$")
#: The literal of ``Symbol('s0', ...)`` / ``Float('1.5', precision=53)``.
_LITERAL = re.compile(r"""^(['"])[A-Za-z0-9_.+-]*\1$""")
_STRING_CALLS = frozenset({"Symbol", "Dummy", "Float", "Integer", "Rational"})
_OPERATORS = frozenset({"(", ")", ",", "=", "+", "-", "*", "/", "**", "//", "%", "<", ">", "<=", ">=",
                        "==", "!=", "~", "&", "|"})


def check_sym_expr(expr: str) -> str | None:
    """Why ``expr`` is not a plain sympy expression (``sympy.sympify`` evaluates it with
    Python's ``eval``), or None: only the names of :data:`SYMPY_NAMES`, bare symbols,
    keyword arguments, numbers, operators, and a quoted literal as the first argument of
    ``Symbol`` / ``Float``; never an attribute, a subscript, another call or string."""
    if not isinstance(expr, str) or not expr.isascii():
        return "not an ASCII string"
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(expr).readline)
                  if t.type not in (tokenize.NEWLINE, tokenize.ENDMARKER)]
    except (tokenize.TokenError, SyntaxError, IndentationError) as exc:
        return f"does not tokenize ({exc})"
    for i, token in enumerate(tokens):
        before = [t.string for t in tokens[max(i - 2, 0):i]]
        after = tokens[i + 1].string if i + 1 < len(tokens) else ""
        if token.type == tokenize.NAME:
            keyword = after == "=" and before[-1:] in (["("], [","])
            if not (token.string in SYMPY_NAMES or _SYMBOL.match(token.string) or
                    (keyword and not token.string.startswith("_"))):
                return f"calls or names {token.string!r}"
        elif token.type == tokenize.STRING:
            if not (_LITERAL.match(token.string) and len(before) == 2 and before[0] in _STRING_CALLS
                    and before[1] == "("):
                return f"has the string {token.string[:40]!r} outside Symbol('...') / Float('...')"
        elif token.type == tokenize.OP:
            if token.string not in _OPERATORS:
                return f"has the operator {token.string!r}"
        elif token.type != tokenize.NUMBER:
            return f"has a {tokenize.tok_name[token.type]} token {token.string[:40]!r}"
    return None


def check_program_json(program: Any, label: str, *, rule: str = PT2_RULE, trust_hint: bool = True) -> None:
    """Refuse a program (torch's JSON serde, parsed) with a symbolic size that is more
    than a plain sympy expression: torch's deserializer would ``eval`` it."""
    for expr in _expr_strs(program):
        why = check_sym_expr(expr)
        if why is not None:
            raise UntrustedInputError.of(label, f"a symbolic size of the program {why}: {str(expr)[:80]!r}", rule,
                                      trust_hint=trust_hint)


def check_program_bytes(data: bytes, label: str, *, rule: str = PT2_RULE, trust_hint: bool = True) -> None:
    """:func:`check_program_json` of a program's JSON bytes, parsed as torch parses them;
    not parsed when no key can be ``expr_str`` (neither the name nor a ``\\u`` escape)."""
    if b"expr_str" not in data and b"\\u" not in data:
        return
    try:
        program = json.loads(data.decode("utf-8"))
    except ValueError:
        return  # torch's deserializer fails on it too: nothing is evaluated
    check_program_json(program, label, rule=rule, trust_hint=trust_hint)


def _expr_strs(value: Any) -> Iterator[Any]:
    """Every ``expr_str`` in a JSON document, depth first (no recursion limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "expr_str" in item:
                yield item["expr_str"]
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
