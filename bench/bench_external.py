"""Weights-only updates (issue 29): cold lowering vs binding a retrain's weights, per model.

For each model (a CNN: ``examples.hf_models:mobilenet_v2``, BatchNorm folded; a transformers
decoder: a random-weight Llama ``hf:`` text-generation program) and target / recipe:

    cold:          lower(model_w1, external_weights=True)                  (export included)
    weights-only:  rebind_weights(cold, model_w2)   -> same .pte, new .ptd   (lowering.rebind)

and checks that the weights-only ``.ptd`` is byte-identical to a cold lowering of
``model_w2``.  Also the device download of the update: the ``.ptd`` only, against the
whole embedded program.  Target: weights-only <= 0.10 x cold (the ratio is measured in
this run, against this run's cold lowering).

    python bench/bench_external.py [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowering.lower import lower  # noqa: E402
from lowering.rebind import rebind_weights  # noqa: E402
from lowering.targets import partitioner_for  # noqa: E402


def cnn(seed: int):
    from examples.hf_models import _randomize_batch_norm, mobilenet_v2

    model, inputs = mobilenet_v2()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    _randomize_batch_norm(model)
    return model.eval(), inputs


def decoders(hidden: int, layers: int):
    """Two hf: text-generation programs of one Llama architecture (seeds 1, 2)."""
    import transformers

    from lowering.hf import load_hf

    programs = []
    root = Path(tempfile.mkdtemp(prefix="bench-external-"))
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128, bos_token_id=1,
            eos_token_id=2))
        model.eval().save_pretrained(root / str(seed))
        programs.append(load_hf(str(root / str(seed)), "text-generation", max_seq_len=64, attn="standard"))
    return programs


def measure(label: str, lower_w1, lower_w2, rebind, embedded_size) -> float:
    start = time.perf_counter()
    cold = lower_w1()
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    update = rebind(cold)
    warm_s = time.perf_counter() - start
    fresh = lower_w2()
    assert update.pte == cold.pte, label
    assert update.ptd == fresh.ptd, f"{label}: the weights-only .ptd differs from a cold lowering's"
    ratio = warm_s / cold_s
    print(f"{label:<28} cold {cold_s:7.2f} s  weights-only {warm_s:6.2f} s  ratio {ratio:5.3f}  "
          f"download {len(update.ptd):>11,} B (.ptd) vs {embedded_size(fresh):>11,} B (whole .pte)  "
          f".pte {len(cold.pte):,} B")
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    ratios = []
    (m1, x), (m2, _) = cnn(1), cnn(2)
    for target in ("portable", "xnnpack"):
        def low(model, external=True, target=target):
            return lower(model, x, partitioner=partitioner_for(target), external_weights=external)

        ratios.append(measure(f"mobilenet_v2/{target}", lambda: low(m1), lambda: low(m2),
                              lambda cold: rebind_weights(cold, m2),
                              lambda fresh, target=target: len(low(m2, False).pte)))
    hf1, hf2 = decoders(args.hidden, args.layers)
    for target, recipe in (("xnnpack", None), ("xnnpack", "8da4w")):
        def low_hf(hf, external=True, target=target, recipe=recipe):
            return lower(hf.lower_input(), partitioner=partitioner_for(target), quantize=recipe,
                         external_weights=external)

        label = f"llama-{args.hidden}x{args.layers}/{target}{'/' + recipe if recipe else ''}"
        ratios.append(measure(label, lambda: low_hf(hf1), lambda: low_hf(hf2),
                              lambda cold, recipe=recipe: rebind_weights(
                                  cold, {"forward": hf2.methods["forward"][0]}, quantize=recipe),
                              lambda fresh, low_hf=low_hf: len(low_hf(hf2, False).pte)))
    worst = max(ratios)
    print(f"worst weights-only / cold: {worst:.3f} (target <= 0.10): {'OK' if worst <= 0.10 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
