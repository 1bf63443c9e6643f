"""Model fingerprints (tasks/fingerprint.py, tasks/model_spec.load_model): what decides
the exported program changes the fingerprint, and nothing else does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tasks.fingerprint import Fingerprint, fingerprint_module
from tasks.model_spec import ModelSpec, ModelSpecError, live_model, load_model

REPO = Path(__file__).resolve().parent.parent

ARCH = """
import torch

class Net(torch.nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.eps = eps

    def forward(self, x):
        return torch.relu(self.fc(x)) + self.eps
"""

FACTORY = """
import pathlib
import torch
import arch

def model():
    torch.manual_seed(0)
    m = arch.Net()
    ckpt = pathlib.Path(__file__).with_name("w.pt")
    if ckpt.exists():
        m.load_state_dict(torch.load(ckpt, weights_only=True))
    return m.eval(), (torch.ones(2, 4),)
"""


def make_model_dir(root: Path, arch: str = ARCH, factory: str = FACTORY) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "arch.py").write_text(textwrap.dedent(arch))
    (root / "factory.py").write_text(textwrap.dedent(factory))
    return root


def load(root: Path, **options):
    return load_model(ModelSpec.parse(f"{root}/factory.py:model"), options or {"version": None})


def test_new_weights_in_a_checkpoint_change_only_the_weights_part(tmp_path):
    root = make_model_dir(tmp_path / "m")
    before = load(root)
    torch.manual_seed(1)
    torch.save({k: torch.randn_like(v) for k, v in before.module.state_dict().items()}, root / "w.pt")
    after = load(root)
    assert Fingerprint.changed(before.fingerprint.to_json(), after.fingerprint.to_json()) == ["weights"]
    assert before.fingerprint.digest != after.fingerprint.digest
    assert not torch.equal(before.module.fc.weight, after.module.fc.weight)


def test_an_edited_sibling_module_changes_the_code_part_and_is_reimported(tmp_path):
    root = make_model_dir(tmp_path / "m")
    before = load(root)
    (root / "arch.py").write_text(textwrap.dedent(ARCH).replace("torch.relu", "torch.tanh"))
    after = load(root)
    assert Fingerprint.changed(before.fingerprint.to_json(), after.fingerprint.to_json()) == ["code"]
    assert "arch" in after.fingerprint.details["code"]["files"]
    x = torch.full((2, 4), -3.0)
    # The new code runs in this same process (the stale `arch` was evicted).
    assert (before.module(x) >= 0).all() and (after.module(x) < 0).any()


def test_two_models_with_their_own_arch_module_each_get_theirs(tmp_path):
    a = make_model_dir(tmp_path / "a")
    b = make_model_dir(tmp_path / "b", arch=ARCH.replace("torch.relu", "torch.sigmoid"))
    la, lb, la2 = load(a), load(b), load(a)
    x = torch.full((2, 4), -3.0)
    assert torch.equal(la.module(x), la2.module(x))
    assert not torch.allclose(la.module(x), lb.module(x))
    assert la.fingerprint.digest == la2.fingerprint.digest != lb.fingerprint.digest


def test_a_helper_used_only_in_forward_is_part_of_the_code(tmp_path):
    root = tmp_path / "h"
    root.mkdir()
    (root / "helpers.py").write_text("import torch\n\ndef act(x):\n    return torch.relu(x)\n")
    (root / "factory.py").write_text(textwrap.dedent("""
        import torch
        from helpers import act

        class Net(torch.nn.Module):
            def forward(self, x):
                return act(x) * 2

        def model():
            return Net(), (torch.ones(3),)
        """))
    before = load(root)
    assert "helpers" in before.fingerprint.details["code"]["files"]
    (root / "helpers.py").write_text("import torch\n\ndef act(x):\n    return torch.tanh(x)\n")
    after = load(root)
    assert Fingerprint.changed(before.fingerprint.to_json(), after.fingerprint.to_json()) == ["code"]


def test_attributes_inputs_and_options_are_parts(tmp_path):
    root = make_model_dir(tmp_path / "m")
    base = load(root)
    make_model_dir(root, factory=FACTORY.replace("arch.Net()", "arch.Net(eps=1e-3)"))
    eps = load(root)
    changed = Fingerprint.changed(base.fingerprint.to_json(), eps.fingerprint.to_json())
    assert "attributes" in changed and "weights" not in changed
    make_model_dir(root, factory=FACTORY.replace("torch.ones(2, 4)", "torch.ones(5, 4)"))
    shape = load(root)
    assert "inputs" in Fingerprint.changed(base.fingerprint.to_json(), shape.fingerprint.to_json())
    make_model_dir(root)
    salted = load(root, version="2")
    assert Fingerprint.changed(base.fingerprint.to_json(), salted.fingerprint.to_json()) == ["options"]


def test_the_same_model_in_another_directory_and_process_has_the_same_fingerprint(tmp_path):
    a = make_model_dir(tmp_path / "one" / "model")
    b = tmp_path / "two" / "elsewhere"
    shutil.copytree(a, b)
    here = load(a).fingerprint.to_json()
    assert load(b).fingerprint.to_json() == here
    code = (
        "import json, sys; from tasks.model_spec import ModelSpec, load_model; "
        f"print(json.dumps(load_model(ModelSpec.parse({str(b / 'factory.py') + ':model'!r}), "
        "{'version': None}).fingerprint.to_json()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_tied_weights_are_hashed_once_and_names_still_count():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 8)
            self.head = torch.nn.Linear(8, 50, bias=False)
            self.head.weight = self.emb.weight

    torch.manual_seed(0)
    m = Tied()
    fp = fingerprint_module(m, (torch.zeros(2, dtype=torch.long),))
    assert fp.details["weights"] == {"tensors": 2, "bytes": 50 * 8 * 4}
    torch.manual_seed(0)
    again = Tied()
    assert fingerprint_module(again, (torch.zeros(2, dtype=torch.long),)).parts["weights"] == fp.parts["weights"]
    # Equal values, but two tensors: the exported program has two inputs, so it differs.
    again.head.weight = torch.nn.Parameter(again.emb.weight.detach().clone())
    assert fingerprint_module(again, (torch.zeros(2, dtype=torch.long),)).parts["weights"] != fp.parts["weights"]


def test_plain_tensor_attributes_and_buffers_are_weights():
    class WithConst(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = torch.tensor([scale])
            self.register_buffer("offset", torch.zeros(3), persistent=False)

        def forward(self, x):
            return x * self.scale + self.offset

    a = fingerprint_module(WithConst(2.0), (torch.ones(3),))
    b = fingerprint_module(WithConst(3.0), (torch.ones(3),))
    assert a.details["weights"]["tensors"] == 2
    assert Fingerprint.changed(a.to_json(), b.to_json()) == ["weights"]


def test_transformers_models_record_their_distribution_and_config():
    transformers = pytest.importorskip("transformers")
    from transformers import BertConfig, BertModel

    def bert(layers):
        torch.manual_seed(0)
        config = BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                            intermediate_size=64, vocab_size=100)
        return BertModel(config).eval()

    ids = (torch.zeros(1, 4, dtype=torch.long),)
    fp = fingerprint_module(bert(1), ids)
    assert fp.details["code"]["distributions"]["transformers"] == transformers.__version__
    assert fp.details["code"]["files"] == {}  # nothing of the project's: installed code by version
    assert fingerprint_module(bert(1), ids).digest == fp.digest
    # A config change that adds no weights of its own still changes the fingerprint.
    m = bert(1)
    m.config.layer_norm_eps = 1e-3
    assert "attributes" in Fingerprint.changed(fp.to_json(), fingerprint_module(m, ids).to_json())


def test_a_model_changed_mid_run_is_refused_by_the_stage_that_reloads_it(tmp_path):
    root = make_model_dir(tmp_path / "m")
    first = load(root)
    (root / "arch.py").write_text(textwrap.dedent(ARCH).replace("torch.relu", "torch.tanh"))
    with pytest.raises(ModelSpecError, match="changed while it was being lowered"):
        live_model(f"{root}/factory.py:model", first.fingerprint.digest, {"version": None})


def test_a_pt2_fingerprint_is_its_bytes(tmp_path):
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    path = tmp_path / "m.pt2"
    torch.export.save(program, str(path))
    one = load_model(ModelSpec.parse(str(path)))
    assert one.fingerprint.kind == "pt2" and one.pt2 == path.read_bytes()
    assert load_model(ModelSpec.parse(str(path))).fingerprint.digest == one.fingerprint.digest


def test_a_package_module_spec_runs_its_edited_code_in_a_long_lived_process(tmp_path, monkeypatch):
    """Issue 22.9d: the fingerprint reads the module's file on disk, so the factory that
    runs must be the file's code too, not the one imported earlier in the process."""
    import uuid

    from tasks.model_spec import ModelSpec, load_model

    package = f"newcomer_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    source = tmp_path / package / "models.py"
    code = "import torch\n\ndef model():\n    torch.manual_seed(0)\n    return torch.nn.Linear(4, {n}), (torch.randn(2, 4),)\n"
    source.write_text(code.format(n=3))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ModelSpec.parse(f"{package}.models:model")
    first = load_model(spec)
    assert first.module.out_features == 3
    source.write_text(code.format(n=5))  # same size, same second: bytecode caches must not hide it
    second = load_model(spec)
    assert second.module.out_features == 5
    assert second.fingerprint.digest != first.fingerprint.digest
    assert load_model(spec).fingerprint.digest == second.fingerprint.digest  # unchanged: no reload needed
