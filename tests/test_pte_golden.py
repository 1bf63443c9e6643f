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
the ``examples.hf_models`` programs are left out of it, each with a message.
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
