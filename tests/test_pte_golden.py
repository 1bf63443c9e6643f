"""The ``.pte`` bytes of every test model and target, pinned (issue 19).

``lowering.lower`` (or ``lower_methods``) is run, in memory, on every model the
tests lower — our test models, the dynamic ones, the control-flow ones, the
multi-method ones and the ``transformers`` architectures — for every target
(portable, reference, xnnpack), and the sha256 of each program is compared with
``tests/golden/pte_sha256.json``.  A refactoring that moves code between modules
must leave every byte unchanged; a change that means to change the bytes updates
the file on purpose:

    LOWERFLOW_UPDATE_GOLDEN=1 ./run test tests/test_pte_golden.py

The file also records the torch and transformers versions it was made with: the
bytes of a program depend on how torch exports it (and transformers' model code),
so under another torch the comparison is skipped, and under another transformers
the ``examples.hf_models`` programs are left out of it, each with a message.  The
flatbuffers release does not change them: a second test packs programs with flatbuffers
25.2.10 (tosa-tools' pin) in place of this environment's (lowering/pte/flatbuffer_builder.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from lowering import lower, lower_methods
from lowering.targets import PORTABLE, partitioner_for
from tasks.model_spec import ModelSpec, load_model

GOLDEN = Path(__file__).resolve().parent / "golden" / "pte_sha256.json"

MODELS = [
    "examples.models:mlp",
    "examples.models:cnn",
    "examples.models:lstm",
    "examples.models:buffer_mutation",
    "examples.models:transformer",
    "examples.models:lifted_constant",
    "examples.models:multi_output",
    "examples.models:integer_inputs",
    "examples.models:cond_linear",
    "examples.models:map_linear",
    "examples.models:encoder_decoder",
    "examples.models:kv_cache_decoder",
    "examples.dynamic_models:dynamic_mlp",
    "examples.dynamic_models:dynamic_ops",
    "examples.dynamic_models:gpt_decoder",
    "tests._models:mlp_with_head",
    "examples.hf_models:mobilenet_v2",
    "examples.hf_models:resnet",
    "examples.hf_models:bert",
    "examples.hf_models:gpt2",
]
TARGETS = (PORTABLE, "reference", "xnnpack")


def versions() -> dict[str, str]:
    """The versions that decide how a model exports (and so its bytes)."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def pte_of(spec: str, target: str) -> bytes:
    """``spec``'s program for ``target`` through the library, in memory."""
    loaded = load_model(ModelSpec.parse(spec))
    partitioner = partitioner_for(target)
    if loaded.methods is not None:
        methods = {name: (m.module, m.inputs, m.dynamic_shapes) for name, m in loaded.methods.items()}
        return lower_methods(methods, partitioner=partitioner,
                             share_mutable_buffers=loaded.share_mutable_buffers).pte
    return lower(loaded.module, loaded.inputs, partitioner=partitioner, dynamic_shapes=loaded.dynamic_shapes).pte


def all_digests() -> dict[str, str]:
    out = {}
    for spec in MODELS:
        for target in TARGETS:
            with torch.random.fork_rng():
                out[f"{spec}/{target}"] = hashlib.sha256(pte_of(spec, target)).hexdigest()
    return out


def test_every_pte_byte_for_byte_as_pinned():
    pytest.importorskip("transformers")
    digests = all_digests()
    if os.environ.get("LOWERFLOW_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"versions": versions(), "sha256": digests}, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(GOLDEN.read_text())
    made, now = pinned["versions"], versions()
    if made["torch"] != now["torch"]:
        pytest.skip(f"golden bytes were made with torch {made['torch']}, this is {now['torch']}")
    assert set(digests) == set(pinned["sha256"]), "the pinned models and targets differ from MODELS x TARGETS"
    compared = digests
    if made["transformers"] != now["transformers"]:
        compared = {k: v for k, v in digests.items() if not k.startswith("examples.hf_models:")}
        print(f"transformers {now['transformers']} (golden: {made['transformers']}): hf models not compared")
    changed = sorted(k for k in compared if compared[k] != pinned["sha256"][k])
    assert not changed, f"{len(changed)} programs changed bytes: {changed}"



#: The flatbuffers release tosa-tools (the ethos-u extra's dependency) pins; the golden
#: bytes were made with a newer one (25.12.19), whose builder shares vtables differently.
OTHER_FLATBUFFERS = "25.2.10"
#: Programs the other release is checked on (every golden program differed before
#: lowering/pte/flatbuffer_builder.py): plain, recurrent, attention, control flow; each
#: target (xnnpack: its payload is a flatbuffer of its own).
OTHER_RELEASE_MODELS = ("examples.models:mlp", "examples.models:lstm", "examples.models:transformer",
                        "examples.models:cond_linear")
#: ``python -c OTHER_RELEASE_SCRIPT SPECS_JSON``, flatbuffers OTHER_FLATBUFFERS first on sys.path:
#: its version, each program's sha256, a .ptd's bytes (hex), and mlp's sha256 when the
#: program is packed by that release's own ``flatbuffers.Builder``.
OTHER_RELEASE_SCRIPT = """
import hashlib, json, sys
import flatbuffers, torch
from lowering.pte import flat_tensor, format
from lowering.pte.flat_tensor import serialize_ptd
from tests.test_pte_golden import TARGETS, ptd_entries, pte_of

def digest(spec, target):
    with torch.random.fork_rng():
        return hashlib.sha256(pte_of(spec, target)).hexdigest()

out = {"version": flatbuffers.__version__, "file": flatbuffers.__file__,
       "sha256": {f"{s}/{t}": digest(s, t) for s in json.loads(sys.argv[1]) for t in TARGETS},
       "ptd": serialize_ptd(ptd_entries()).hex()}
format.Builder = flat_tensor.Builder = flatbuffers.Builder
out["plain_builder_mlp"] = digest("examples.models:mlp", "portable")
print(json.dumps(out))
"""


def ptd_entries() -> dict:
    """A .ptd's entries: two tensors and a blob (NamedData tables with and without a layout)."""
    from lowering.pte.flat_tensor import PtdEntry, TensorLayout

    return {"a.weight": PtdEntry(b"\1" * 24, TensorLayout(6, (2, 3), (0, 1))),
            "b.bias": PtdEntry(b"\2" * 12, TensorLayout(6, (3,), (0,))), "blob": PtdEntry(b"xyz")}


def test_the_bytes_do_not_depend_on_the_flatbuffers_release(tmp_path):
    """With flatbuffers 25.2.10 first on ``sys.path`` (installed into a temporary
    directory, never into this environment), the programs are the pinned bytes and a
    .ptd is the same bytes as here; that release's own Builder does lay them out
    differently (what lowering/pte/flatbuffer_builder.py undoes)."""
    import subprocess
    import sys

    from lowering.pte.flat_tensor import serialize_ptd

    pinned = json.loads(GOLDEN.read_text())
    if pinned["versions"]["torch"] != torch.__version__:
        pytest.skip(f"golden bytes were made with torch {pinned['versions']['torch']}, this is {torch.__version__}")
    other = tmp_path / "flatbuffers"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                          "--target", str(other), f"flatbuffers=={OTHER_FLATBUFFERS}"],
                         capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        pytest.skip(f"pip cannot install flatbuffers=={OTHER_FLATBUFFERS} into a temporary directory "
                    f"(no package index reachable?): {(pip.stderr.strip().splitlines() or [''])[-1]}")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(other), str(root)])}
    run = subprocess.run([sys.executable, "-c", OTHER_RELEASE_SCRIPT, json.dumps(OTHER_RELEASE_MODELS)], cwd=root,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-5000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["version"] == OTHER_FLATBUFFERS and out["file"].startswith(str(other)), out["file"]
    expected = {f"{s}/{t}": pinned["sha256"][f"{s}/{t}"] for s in OTHER_RELEASE_MODELS for t in TARGETS}
    assert out["sha256"] == expected, sorted(k for k in expected if out["sha256"][k] != expected[k])
    assert bytes.fromhex(out["ptd"]) == serialize_ptd(ptd_entries())
    assert out["plain_builder_mlp"] != expected["examples.models:mlp/portable"]  # that release does differ
