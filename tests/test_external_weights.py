"""Issue 29: weights apart from programs (``.pte`` + ``.ptd``), on ExecuTorch's runtime.

Per model (an MLP, a CNN with BatchNorm, a transformers BERT, a Llama-style ``hf:``
decoder) and target (portable, xnnpack; the decoder also 8da4w)::

    lower(model_w1, external_weights=True) -> a.pte + w1.ptd
    lower(model_w2, external_weights=True) -> b.pte + w2.ptd        (same architecture, new weights)
    b.pte == a.pte (byte-identical)
    ExecuTorch: a.pte + w1.ptd == lower(model_w1).pte (embedded)
    ExecuTorch: a.pte + w2.ptd == model_w2 (the new weights' outputs)

and the safety checks of :func:`lowering.external.check_pair` (missing file, missing
key, wrong layout, another architecture's ``.ptd``): one line each, before anything runs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("executorch.runtime")

from lowering import lower  # noqa: E402
from lowering.external import ExternalDataError, check_pair, required_data  # noqa: E402
from lowering.pte.flat_tensor import PtdEntry, TensorLayout, deserialize_ptd, serialize_ptd  # noqa: E402
from lowering.runtime import load  # noqa: E402
from lowering.targets import partitioner_for  # noqa: E402
from lowering.verify_executorch import executorch_runner, with_data  # noqa: E402


def run_executorch(pte: bytes, ptd: bytes | None, inputs, name: str = "forward") -> list:
    """Outputs of ``name`` on ExecuTorch's runtime: the ``.pte`` with its ``.ptd`` (verify's
    runner: the kernel libraries the program needs, the pair checked first)."""
    return executorch_runner().sequence(with_data(pte, ptd), [name], [(name, list(inputs))])[0]


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean(dim=(2, 3)))


def trained(cls, seed: int) -> torch.nn.Module:
    """A model of ``cls`` with weights of ``seed`` (BatchNorm statistics too: a retrain)."""
    torch.manual_seed(seed)
    model = cls()
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def bert(seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=48, max_position_embeddings=16)

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = transformers.BertModel(config).eval()

        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state

    return Encoder().eval()


CASES = {
    "mlp": (lambda seed: trained(MLP, seed), lambda: (torch.randn(2, 8),)),
    "cnn_bn": (lambda seed: trained(CNN, seed), lambda: (torch.randn(1, 3, 8, 8),)),
    "bert": (bert, lambda: (torch.randint(0, 64, (1, 8)),)),
}


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_retrain_ships_only_a_new_ptd(case, target, tmp_path):
    make, inputs_of = CASES[case]
    torch.manual_seed(7)
    inputs = inputs_of()
    m1, m2 = make(1), make(2)
    e1 = lower(m1, inputs, partitioner=partitioner_for(target))
    r1 = lower(m1, inputs, partitioner=partitioner_for(target), external_weights=True)
    r2 = lower(m2, inputs, partitioner=partitioner_for(target), external_weights=True)
    assert r2.pte == r1.pte  # the program did not change: byte-identical
    assert r2.ptd != r1.ptd and e1.ptd is None
    assert len(r1.pte) < len(e1.pte)
    check_pair(r1.pte, r2.ptd)
    embedded = run_executorch(e1.pte, None, inputs)
    external = run_executorch(r1.pte, r1.ptd, inputs)
    torch.testing.assert_close(external, embedded, atol=0, rtol=0)
    with torch.no_grad():
        expected = m2(*inputs)
    retrained = run_executorch(r1.pte, r2.ptd, inputs)  # last night's .pte, tonight's .ptd
    torch.testing.assert_close(retrained[0], expected, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(retrained[0], external[0], atol=1e-3)
    ours = load(r1.pte, r2.ptd).run("forward", list(inputs))  # lowerflow's runtime binds it too
    torch.testing.assert_close(ours[0], expected, atol=2e-5, rtol=1e-4)


def test_xnnpack_keys_name_the_weight_and_its_role():
    m = trained(CNN, 1)
    result = lower(m, (torch.randn(1, 3, 8, 8),), partitioner=partitioner_for("xnnpack"), external_weights=True)
    keys = set(deserialize_ptd(result.ptd))
    assert "fc.bias" in keys and "conv.weight" not in keys, keys  # the filter is folded with BatchNorm
    assert not any(len(k) == 64 and all(c in "0123456789abcdef" for c in k) for k in keys), keys  # no sha256
    assert set(required_data(result.pte)) == keys


def test_the_flag_off_changes_nothing():
    """Without external_weights the .pte is what it was (embedded weights, sha256 keys)."""
    m = trained(MLP, 1)
    x = (torch.randn(2, 8),)
    result = lower(m, x, partitioner=partitioner_for("xnnpack"))
    assert result.ptd is None and required_data(result.pte) == {}


# --------------------------------------------------------------------------- safety


@pytest.fixture(scope="module")
def pair():
    m = trained(MLP, 1)
    x = (torch.randn(2, 8),)
    return {target: lower(m, x, partitioner=partitioner_for(target), external_weights=True)
            for target in ("portable", "xnnpack")}


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_missing_ptd_is_one_line(pair, target):
    with pytest.raises(ExternalDataError, match=r"needs external data .* no \.ptd was given") as info:
        check_pair(pair[target].pte, None, pte_name="mlp.pte")
    assert "\n" not in str(info.value) and "mlp.pte" in str(info.value)


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_missing_key_is_one_line(pair, target):
    entries = deserialize_ptd(pair[target].ptd)
    dropped = sorted(entries)[0]
    del entries[dropped]
    with pytest.raises(ExternalDataError, match=rf"does not hold 1 of the .*{dropped!r}") as info:
        check_pair(pair[target].pte, serialize_ptd(entries), ptd_name="w.ptd")
    assert "\n" not in str(info.value)


def test_wrong_layout_is_one_line(pair):
    entries = deserialize_ptd(pair["portable"].ptd)
    key = "fc1.bias"
    entries[key] = PtdEntry(entries[key].data[:32], TensorLayout(6, (8,), (0,)))
    with pytest.raises(ExternalDataError, match=r"weight 'fc1.bias' .* is float32\[8\] .* float32\[16\]"):
        check_pair(pair["portable"].pte, serialize_ptd(entries))


def test_wrong_size_of_a_delegate_blob_is_one_line(pair):
    entries = deserialize_ptd(pair["xnnpack"].ptd)
    key = "fc1.bias"
    entries[key] = PtdEntry(entries[key].data[:32])
    with pytest.raises(ExternalDataError, match=r"weight 'fc1.bias' \(delegate XnnpackBackend\) has 32 bytes, 64"):
        check_pair(pair["xnnpack"].pte, serialize_ptd(entries))


def test_a_ptd_of_another_architecture_is_one_line(pair):
    other = lower(trained(CNN, 1), (torch.randn(1, 3, 8, 8),), external_weights=True)
    with pytest.raises(ExternalDataError, match="the data of another program"):
        check_pair(pair["portable"].pte, other.ptd)
    with pytest.raises(ExternalDataError, match="not an ExecuTorch data file"):
        check_pair(pair["portable"].pte, pair["portable"].pte)


# --------------------------------------------------------------------------- hf: decoder


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory):
    """Two save_pretrained directories of one tiny Llama architecture, different weights."""
    transformers = pytest.importorskip("transformers")
    dirs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2))
        dirs.append(tmp_path_factory.mktemp(f"llama{seed}"))
        model.eval().save_pretrained(dirs[-1])
    return dirs


@pytest.mark.parametrize("target, recipe", [("portable", None), ("xnnpack", None), ("xnnpack", "8da4w")])
def test_decoder_retrain_ships_only_a_new_ptd(llama_dirs, target, recipe, tmp_path):
    """A Llama-style hf: text-generation program (forward + constant methods, KV cache in the
    .pte): tonight's .ptd on last night's .pte gives tonight's logits."""
    from lowering.hf import load_hf

    programs = [load_hf(str(d), "text-generation", max_seq_len=16, attn="standard") for d in llama_dirs]

    def lowered(hf, external):
        return lower(hf.lower_input(), partitioner=partitioner_for(target), quantize=recipe,
                     external_weights=external)

    r1, r2 = lowered(programs[0], True), lowered(programs[1], True)
    assert r1.pte == r2.pte and r1.ptd != r2.ptd
    check_pair(r1.pte, r2.ptd)
    tokens, positions = torch.tensor([[5, 9, 17]]), torch.arange(3)
    retrained = run_executorch(r1.pte, r2.ptd, [tokens, positions])[0]
    if recipe is None:  # fp32: tonight's eager logits
        with torch.no_grad():
            expected = programs[1].methods["forward"][0](tokens, positions)
        expected = expected[0] if isinstance(expected, (tuple, list)) else expected
        torch.testing.assert_close(retrained, expected, atol=1e-4, rtol=1e-4)
    else:  # quantized: tonight's embedded program
        embedded = run_executorch(lowered(programs[1], False).pte, None, [tokens, positions])[0]
        torch.testing.assert_close(retrained, embedded, atol=1e-5, rtol=1e-5)
    before = run_executorch(r1.pte, r1.ptd, [tokens, positions])[0]
    assert not torch.allclose(before, retrained, atol=1e-3)


# --------------------------------------------------------------------------- weights-only updates


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_rebind_gives_the_cold_lowerings_files(target):
    """lowering.rebind: tonight's weights bound to last night's lowered program: the same
    .pte, and the .ptd a cold lowering of tonight's model writes (byte for byte)."""
    from lowering.rebind import rebind_weights

    x = (torch.randn(1, 3, 8, 8),)
    m1, m2 = trained(CNN, 1), trained(CNN, 2)
    cold = lower(m1, x, partitioner=partitioner_for(target), external_weights=True)
    update = rebind_weights(cold, m2)
    fresh = lower(m2, x, partitioner=partitioner_for(target), external_weights=True)
    assert update.pte == cold.pte and update.ptd == fresh.ptd and update.ptd != cold.ptd


def test_rebind_refuses_what_is_not_weights_only():
    from lowering.rebind import NotWeightsOnly, rebind_weights

    x = (torch.randn(2, 8),)
    cold = lower(trained(MLP, 1), x, external_weights=True)
    with pytest.raises(NotWeightsOnly, match="another architecture"):
        rebind_weights(cold, torch.nn.Sequential(torch.nn.Linear(8, 4)))
    wider = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in trained(MLP, 2).state_dict().items()}
    with pytest.raises(NotWeightsOnly, match="another architecture"):
        rebind_weights(cold, wider)
    with pytest.raises(NotWeightsOnly, match="int8 \\(static\\) calibrates activations"):
        rebind_weights(cold, trained(MLP, 2), quantize="int8")
    with pytest.raises(NotWeightsOnly, match="not lowered with external_weights"):
        rebind_weights(lower(trained(MLP, 1), x), trained(MLP, 2))


def test_portable_and_xnnpack_share_one_ptd_where_layouts_allow(pair):
    """The MLP's weights are stored the same way by both targets (XNNPACK reads the folded
    [in, out] weight as it is): one .ptd serves both programs."""
    assert pair["portable"].ptd == pair["xnnpack"].ptd
    x = torch.randn(2, 8)
    shared = run_executorch(pair["xnnpack"].pte, pair["portable"].ptd, [x])
    torch.testing.assert_close(shared[0], trained(MLP, 1)(x), atol=2e-5, rtol=1e-4)


def test_the_methods_of_one_program_share_one_ptd():
    """Two methods reading one module's weights: one .ptd, each weight in it once."""
    m = trained(MLP, 1)
    result = lower({"a": (m, (torch.randn(2, 8),)), "b": (m, (torch.randn(3, 8),))}, external_weights=True)
    entries = deserialize_ptd(result.ptd)
    assert set(entries) == set(deserialize_ptd(lower(m, (torch.randn(2, 8),), external_weights=True).ptd))
    check_pair(result.pte, result.ptd)


@pytest.mark.parametrize("target", ["portable", "xnnpack"])
def test_two_methods_folding_views_of_different_weights(target):
    """examples/models.py:encoder_decoder: each method folds a transposed view of its own
    weights; the folded constants are named after their weights (``head.weight#t``), not the
    per-method node (two methods' ``_folded_permute``, different bytes), so the program has
    one .ptd that runs equal to the embedded one, and a retrain rebinds to the same .pte."""
    from examples.models import encoder_decoder
    from lowering.rebind import rebind_weights

    def methods(seed: int | None):
        program = encoder_decoder()
        if seed is not None:  # same architecture, new weights (both methods share one Seq2Seq)
            torch.manual_seed(seed)
            with torch.no_grad():
                for p in program["encode"][0].model.parameters():
                    p.copy_(torch.randn_like(p) * 0.2)
        return program

    partitioner = partitioner_for(target) if target != "portable" else None
    embedded = lower(methods(None), partitioner=partitioner)
    cold = lower(methods(None), partitioner=partitioner, external_weights=True)
    assert any("#t" in key for key in deserialize_ptd(cold.ptd))
    check_pair(cold.pte, cold.ptd)
    tonight = methods(2)
    update = rebind_weights(cold, {name: module for name, (module, _) in tonight.items()})
    assert update.pte == cold.pte and update.ptd == lower(methods(2), partitioner=partitioner,
                                                          external_weights=True).ptd != cold.ptd
    for name, (module, inputs) in tonight.items():
        torch.testing.assert_close(run_executorch(cold.pte, cold.ptd, inputs, name)[0],
                                   run_executorch(embedded.pte, None, inputs, name)[0], atol=1e-6, rtol=1e-6)
        with torch.no_grad():
            expected = module(*inputs)
        torch.testing.assert_close(run_executorch(cold.pte, update.ptd, inputs, name)[0], expected,
                                   atol=1e-4, rtol=1e-4)
