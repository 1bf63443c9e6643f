"""Shared helpers of the .pte tests: ExecuTorch-produced programs and eager references.

ExecuTorch (the oracle) is only imported inside functions, so that test modules
can ``pytest.importorskip("executorch")`` before calling them.
"""

from __future__ import annotations

import functools
import warnings

import torch

from examples.models import MODELS


@functools.lru_cache(maxsize=None)
def model_and_inputs(name: str):
    """The model ``name`` of examples.models and its example inputs (built once)."""
    return MODELS[name]()


def eager_outputs(name: str, inputs=None):
    """Flat list of eager outputs of a freshly built model ``name``."""
    model, example = MODELS[name]()
    with torch.no_grad():
        result = model(*(inputs if inputs is not None else example))
    return flatten(result)


def flatten(tree) -> list:
    """Leaves of a nested tuple/list/dict output, in pytree order."""
    return torch.utils._pytree.tree_leaves(tree)


@functools.lru_cache(maxsize=None)
def executorch_pte(name: str) -> bytes:
    """The .pte that ExecuTorch itself produces for model ``name`` (default config)."""
    from executorch.exir import to_edge

    model, inputs = MODELS[name]()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(model, inputs)
        return bytes(to_edge(exported).to_executorch().buffer)


def run_in_executorch(pte: bytes, inputs, calls: int = 1) -> list[list[torch.Tensor]]:
    """Outputs of ``calls`` successive executions of forward on one loaded Method."""
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(pte).load_method("forward")
    return [list(method.execute(list(inputs))) for _ in range(calls)]


def assert_all_close(actual, expected, *, atol=1e-5, rtol=1e-4) -> None:
    """Equal length, and every pair of tensors equal in dtype and shape and close in value."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype, (i, a.dtype, e.dtype)
        assert a.shape == e.shape, (i, a.shape, e.shape)
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=f"output {i}")
