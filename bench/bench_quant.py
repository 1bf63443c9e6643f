"""Quantized ``xnnpack`` programs, lowerflow vs ExecuTorch's own quantized XNNPACK lowering.

Per model and recipe, in one run, with the same calibration batches:

* ExecuTorch: ``int8`` / ``int8-dynamic``: PT2E with ``XNNPACKQuantizer`` +
  ``get_symmetric_quantization_config(is_per_channel=True[, is_dynamic=True])``,
  ``prepare_pt2e``, calibration, ``convert_pt2e``, re-export; ``8da4w``: torchao
  ``quantize_(Int8DynamicActivationIntxWeightConfig(int4, PerGroup(32)))`` + export;
  then ``to_edge_transform_and_lower(ep, [XnnpackPartitioner()]).to_executorch()``;
* lowerflow: ``lowering.lower(model, inputs, quantize=recipe, calibration=batches,
  partitioner=partitioner_for("xnnpack"))``.

Columns: lowering seconds (export + quantization + lowering) and ratio; .pte bytes and
ratio; latency on the ExecuTorch runtime, both programs interleaved call by call
(median of ``--calls`` calls each after 20 warm-ups) and ratio; error against fp32
eager (max |Δ| / max |fp32|) of each program run on the ExecuTorch runtime.

Targets (issue 20): bytes <= ExecuTorch's every model; latency <= 1.05x geomean and
<= 1.25x each; error <= ExecuTorch's (within 10 %) every model; lowering time <= 0.25x
geomean.

    python bench/bench_quant.py [--calls N] [--recipes int8,int8-dynamic,8da4w] [model ...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_xnnpack's latency measure

from lowering.lower import lower  # noqa: E402
from lowering.targets import partitioner_for  # noqa: E402

RECIPES = ("int8", "int8-dynamic", "8da4w")
CALIBRATION_BATCHES = 16


# --------------------------------------------------------------------------- models


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(64, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 10)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def mlp():
    torch.manual_seed(0)
    return MLP().eval(), (torch.randn(4, 64),)


def cnn():
    from examples.models import MODELS

    return MODELS["cnn"]()


def transformer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    for p in model.parameters():  # distinct layers
        torch.nn.init.normal_(p, std=0.05)
    return model, (torch.randn(1, 32, 128),)


def _hf(name: str):
    def factory():
        from examples import hf_models

        return hf_models.MODELS[name]()

    return factory


def bert_ids():
    """A 2-layer BertModel (hidden 128, 4 heads, intermediate 256) on token ids alone: with the
    attention mask (``hf_bert``) ExecuTorch's int8 flow fails here (its XNNPACKQuantizer quantizes
    the mask's index tensors: "tensors used as indices must be long"), so this is the int8 BERT
    both flows lower (issue 28: lowerflow's was 2% larger)."""
    import transformers

    from examples.hf_models import _TensorOutput, _seeded

    _seeded()
    config = transformers.BertConfig(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=32, attn_implementation="eager")
    model = transformers.BertModel(config, add_pooling_layer=True).eval()
    return _TensorOutput(model, ("last_hidden_state", "pooler_output")).eval(), (torch.randint(0, 128, (2, 12)),)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = LlamaForCausalLM(config).eval()

        def forward(self, tokens):
            return self.model(input_ids=tokens, use_cache=False).logits

    return Logits(), (torch.randint(0, 512, (1, 16)),)


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "hf_resnet": _hf("resnet"),
          "hf_bert": _hf("bert"), "hf_bert_ids": bert_ids, "llama": llama}
#: Recipes that make sense per model (8da4w quantizes linear layers only).
DEFAULT_RECIPES = {"cnn": ("int8", "int8-dynamic"), "hf_resnet": ("int8", "int8-dynamic"), "llama": ("8da4w", "int8-dynamic")}


def calibration(inputs, count: int = CALIBRATION_BATCHES):
    """``count`` batches shaped like ``inputs`` (integer inputs: token ids in their range)."""
    g = torch.Generator().manual_seed(1234)
    batches = []
    for _ in range(count):
        batch = []
        for x in inputs:
            if x.is_floating_point():
                batch.append(torch.randn(x.shape, generator=g, dtype=x.dtype))
            else:
                batch.append(torch.randint(0, int(x.max()) + 1, x.shape, generator=g, dtype=x.dtype))
        batches.append(tuple(batch))
    return batches


# --------------------------------------------------------------------------- the two flows


def lower_executorch(model, inputs, recipe: str, batches) -> tuple[float, bytes]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    start = time.perf_counter()
    with torch.no_grad():
        if recipe == "8da4w":
            from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup, quantize_
            from torchao.utils import unwrap_tensor_subclass

            model = copy.deepcopy(model)
            quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
                                                                   weight_granularity=PerGroup(32)))
            model = unwrap_tensor_subclass(model)
        else:
            from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
                XNNPACKQuantizer,
                get_symmetric_quantization_config,
            )
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

            config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=recipe == "int8-dynamic")
            prepared = prepare_pt2e(torch.export.export(model, inputs, strict=False).module(),
                                    XNNPACKQuantizer().set_global(config))
            for batch in (batches if recipe == "int8" else batches[:1]):
                prepared(*batch)
            model = convert_pt2e(prepared)
        ep = torch.export.export(model, inputs, strict=False)
        pte = bytes(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    return time.perf_counter() - start, pte


def lower_lowerflow(model, inputs, recipe: str, batches) -> tuple[float, bytes]:
    start = time.perf_counter()
    with torch.no_grad():
        pte = lower(model, inputs, quantize=recipe, calibration=batches if recipe == "int8" else None,
                    partitioner=partitioner_for("xnnpack")).pte
    return time.perf_counter() - start, pte


# --------------------------------------------------------------------------- measurements


def latencies(ptes: list[bytes], inputs, calls: int) -> list[float]:
    """Median µs per call of each program on ExecuTorch's runtime, calls interleaved
    (bench_xnnpack's measure)."""
    from bench_xnnpack import latencies as latencies_ms

    return [ms * 1e3 for ms in latencies_ms(ptes, inputs, calls)]


def error(pte: bytes, expected: list[torch.Tensor], inputs) -> float:
    """max |Δ| / max |fp32| of the program on ExecuTorch's runtime."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    got = program.load_method("forward").execute(list(inputs))
    return max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(got, expected) if e.is_floating_point())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--recipes", default=None, help="comma-separated; default: per model")
    parser.add_argument("models", nargs="*", default=list(MODELS))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)

    model, inputs = mlp()  # warm-ups: one-time costs of both flows
    lower_executorch(model, inputs, "int8", calibration(inputs, 2))
    lower_lowerflow(model, inputs, "int8", calibration(inputs, 2))
    print(f"latency: median of {args.calls} interleaved calls on ExecuTorch's runtime; "
          f"{CALIBRATION_BATCHES} calibration batches (the same for both)\n")
    header = (f"{'model':12} {'recipe':12} {'ET s':>6} {'LF s':>6} {'time':>6}   {'ET bytes':>9} {'LF bytes':>9} "
              f"{'bytes':>6}   {'ET µs':>8} {'LF µs':>8} {'lat':>6}   {'ET err':>7} {'LF err':>7}")
    print(header)
    print("-" * len(header))
    rows = []
    for name in args.models:
        recipes = args.recipes.split(",") if args.recipes else DEFAULT_RECIPES.get(name, RECIPES)
        for recipe in recipes:
            model, inputs = MODELS[name]()
            batches = calibration(inputs)
            with torch.no_grad():
                expected = torch.utils._pytree.tree_leaves(model(*inputs))
            try:
                lf_s, lf_pte = lower_lowerflow(model, inputs, recipe, batches)
            except Exception as exc:  # a failure is a row, the bench goes on
                print(f"{name:12} {recipe:12} lowerflow FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
                continue
            try:
                et_s, et_pte = lower_executorch(model, inputs, recipe, batches)
            except Exception as exc:  # ExecuTorch's own flow fails on some models: lowerflow's row alone
                [lf_us] = latencies([lf_pte], inputs, args.calls)
                print(f"{name:12} {recipe:12} {'—':>6} {lf_s:6.2f} {'':6}   {'—':>9} {len(lf_pte):9,} {'':6}   "
                      f"{'—':>8} {lf_us:8.1f} {'':6}   {'—':>7} {error(lf_pte, expected, inputs):7.4f}   "
                      f"(ExecuTorch's flow failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
                continue
            et_us, lf_us = latencies([et_pte, lf_pte], inputs, args.calls)
            et_err, lf_err = error(et_pte, expected, inputs), error(lf_pte, expected, inputs)
            row = (lf_s / et_s, len(lf_pte) / len(et_pte), lf_us / et_us, lf_err, et_err)
            rows.append(row)
            print(f"{name:12} {recipe:12} {et_s:6.2f} {lf_s:6.2f} {row[0]:6.3f}   {len(et_pte):9,} {len(lf_pte):9,} "
                  f"{row[1]:6.3f}   {et_us:8.1f} {lf_us:8.1f} {row[2]:6.3f}   {et_err:7.4f} {lf_err:7.4f}")
            sys.stdout.flush()
    if not rows:
        return
    geo = lambda xs: statistics.geometric_mean(xs)  # noqa: E731
    print("-" * len(header))
    print(f"{'geomean':25} {'':6} {'':6} {geo([r[0] for r in rows]):6.3f}   {'':9} {'':9} "
          f"{geo([r[1] for r in rows]):6.3f}   {'':8} {'':8} {geo([r[2] for r in rows]):6.3f}")
    print(f"\ntargets: bytes <= ET every model: {all(r[1] <= 1.0 for r in rows)}; "
          f"latency <= 1.05x geomean: {geo([r[2] for r in rows]) <= 1.05}, <= 1.25x each: "
          f"{all(r[2] <= 1.25 for r in rows)}; error <= 1.1x ET every model: "
          f"{all(r[3] <= 1.1 * r[4] + 1e-6 for r in rows)}; time <= 0.25x geomean: {geo([r[0] for r in rows]) <= 0.25}")


if __name__ == "__main__":
    main()
