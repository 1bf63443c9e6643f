"""Issue 29's weights-only path for a Llama-style ``hf:`` decoder (text-generation: a traced
``forward`` with its KV cache, and constant methods) through the flow: with external weights,
a retrain (``save_pretrained`` of new weights into the same directory) hits every graph stage,
keyed on the model's structure (config + the safetensors headers' names, dtypes and shapes:
no weight byte read), and runs only ``bind_weights_methods`` and verify.  Tonight's ``.pte``
is last night's byte for byte, its ``.ptd`` is the library's cold lowering's of the new
weights, and last night's ``.pte`` with tonight's ``.ptd`` gives the new model's logits on the
ExecuTorch runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("executorch.runtime")
transformers = pytest.importorskip("transformers")

from flows.lower_fleet import lower_fleet  # noqa: E402
from lowering import lower  # noqa: E402
from lowering.targets import partitioner_for  # noqa: E402
from lowering.verify_executorch import executorch_runner, with_data  # noqa: E402
from tests._lowering import executions_during  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_stages")

HF = {"task": "text-generation", "max_seq_len": 16}


def save_llama(directory: Path, seed: int) -> None:
    """A tiny random Llama checkpoint (the retrain: the same config, other weights)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2))
    model.eval().save_pretrained(directory)


def cold(directory: Path, target: str, recipe):
    from lowering.hf import load_hf

    program = load_hf(str(directory), HF["task"], max_seq_len=HF["max_seq_len"])  # as the flow loads it
    return lower(program.lower_input(), partitioner=partitioner_for(target), quantize=recipe,
                 external_weights=True), program


def published(ref: dict) -> bytes:
    return Path(ref["uri"].removeprefix("file://")).read_bytes()


def test_the_structure_digest_of_an_hf_model_reads_only_headers(tmp_path):
    from tasks.fingerprint import safetensors_layout
    from tasks.model_spec import ModelSpec, load_model

    prints = []
    for seed in (1, 2):
        save_llama(tmp_path / "llama", seed)
        prints.append(load_model(ModelSpec.parse(f"hf:{tmp_path / 'llama'}"), {"hf": HF}).fingerprint)
    assert prints[0].digest != prints[1].digest and prints[0].structure_digest == prints[1].structure_digest
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"not read")
    assert safetensors_layout([tmp_path / "bin" / "pytorch_model.bin"]) is None  # a pickle: no layout


@pytest.mark.parametrize("targets, recipe", [(("portable", "xnnpack"), None), (("xnnpack",), "8da4w")])
def test_a_retrained_decoder_ships_only_a_new_ptd(tmp_path, targets, recipe):
    directory = tmp_path / "llama"
    save_llama(directory, 1)
    manifest = {"store": str(tmp_path / "store"), "defaults": {"targets": list(targets)},
                "models": [{"name": "llama", "model": f"hf:{directory}", **HF, "external_weights": True,
                            **({"quantize": recipe} if recipe else {})}]}
    first = lower_fleet(manifest)["models"]["llama"]
    save_llama(directory, 2)  # tonight's retrain, same architecture
    summary, ran = executions_during(lower_fleet, manifest)
    second = summary["models"]["llama"]
    assert dict(ran) == {"bind_weights_methods": len(targets), "verify": len(targets)}, dict(ran)
    assert second["changed"] == ["weights"]
    tokens, positions = torch.tensor([[5, 9, 17]]), torch.arange(3)
    for target in targets:
        entry, before = second["targets"][target], first["targets"][target]
        assert entry["ok"], entry["error"]
        # the .ptd from emit's recipes; a recipe's verify reference from its quantized programs' tables
        assert entry["weights_only"] == {"bind_weights": "rebound", **({"quantized": "weights"} if recipe else {}),
                                         "ptd": "replayed"}
        assert entry["pte"]["sha256"] == before["pte"]["sha256"] and entry["ptd"]["sha256"] != before["ptd"]["sha256"]
        library, program = cold(directory, target, recipe)
        assert (published(entry["pte"]), published(entry["ptd"])) == (library.pte, library.ptd)  # flow = library
        # last night's .pte with tonight's .ptd: tonight's logits (fp32: eager; 8da4w: its embedded program)
        old_pte = published(before["pte"])
        logits = executorch_runner().sequence(with_data(old_pte, library.ptd), ["forward"],
                                              [("forward", [tokens, positions])])[0][0]
        if recipe is None:
            with torch.no_grad():
                expected = program.methods["forward"][0](tokens, positions)
            expected = expected[0] if isinstance(expected, (tuple, list)) else expected
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        else:
            embedded = lower(program.lower_input(), partitioner=partitioner_for(target), quantize=recipe).pte
            expected = executorch_runner().sequence(embedded, ["forward"], [("forward", [tokens, positions])])[0][0]
            torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


#: A tiny transformers BERT encoder whose weights come from seed.txt beside it (the retrain).
BERT = '''
import pathlib
import torch
import transformers
from examples.hf_models import _TensorOutput


def bert():
    torch.manual_seed(int((pathlib.Path(__file__).parent / "seed.txt").read_text()))
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=16, attn_implementation="eager"), add_pooling_layer=True).eval()
    ids, mask = torch.tensor([[3, 9, 27, 5, 11, 60, 2, 0]]), torch.ones(1, 8, dtype=torch.long)
    mask[0, 6:] = 0
    return _TensorOutput(model, ("last_hidden_state", "pooler_output")).eval(), (ids, mask)
'''


def test_a_retrained_bert_ships_only_a_new_ptd(tmp_path):
    """A transformers BertModel through the flow, portable and xnnpack: a retrain night runs only
    bind_weights and verify, the .pte is last night's, flow = library for both files, and last
    night's .pte with tonight's .ptd gives tonight's outputs on ExecuTorch's runtime."""
    import importlib.util

    targets = ("portable", "xnnpack")
    (tmp_path / "retrained.py").write_text(BERT)
    (tmp_path / "seed.txt").write_text("1")
    manifest = {"store": str(tmp_path / "store"), "defaults": {"targets": list(targets)},
                "models": [{"name": "bert", "model": f"{tmp_path / 'retrained.py'}:bert", "external_weights": True}]}
    first = lower_fleet(manifest)["models"]["bert"]
    (tmp_path / "seed.txt").write_text("2")
    summary, ran = executions_during(lower_fleet, manifest)
    second = summary["models"]["bert"]
    assert dict(ran) == {"bind_weights": len(targets), "verify": len(targets)}, dict(ran)
    assert second["changed"] == ["weights"]
    spec = importlib.util.spec_from_file_location("bert_tonight", tmp_path / "retrained.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, inputs = module.bert()  # tonight's weights
    with torch.no_grad():
        expected = model(*inputs)
    for target in targets:
        entry, before = second["targets"][target], first["targets"][target]
        assert entry["ok"], entry["error"]
        assert entry["weights_only"] == {"bind_weights": "rebound", "ptd": "replayed"}
        assert entry["pte"]["sha256"] == before["pte"]["sha256"] and entry["ptd"]["sha256"] != before["ptd"]["sha256"]
        library = lower(model, inputs, partitioner=partitioner_for(target), external_weights=True)
        assert (published(entry["pte"]), published(entry["ptd"])) == (library.pte, library.ptd)  # flow = library
        outputs = executorch_runner().sequence(with_data(published(before["pte"]), published(entry["ptd"])),
                                               ["forward"], [("forward", list(inputs))])[0]
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
