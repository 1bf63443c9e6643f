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


class ExecutorchMethod:
    """``forward`` of a ``.pte`` loaded in ExecuTorch's runtime, holding its ``Program``.

    ExecuTorch reads constants, mutable buffers' initial values and delegate
    payloads in place from the bytes a program was loaded from, and only its
    ``Program`` references those bytes: its ``Method`` does not reference the
    ``Program``.  ``load_program(pte).load_method("forward")`` on bytes nobody
    else holds runs on freed memory (NaN outputs, or a crash), so the method is
    kept here together with its program.
    """

    def __init__(self, pte: bytes, name: str = "forward") -> None:
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(pte)
        self.method = self.program.load_method(name)

    def execute(self, inputs) -> list:
        return list(self.method.execute(list(inputs)))


def run_in_executorch(pte: bytes, inputs, calls: int = 1) -> list[list[torch.Tensor]]:
    """Outputs of ``calls`` successive executions of forward on one loaded Method."""
    method = ExecutorchMethod(pte)
    return [method.execute(inputs) for _ in range(calls)]


def assert_all_close(actual, expected, *, atol=1e-5, rtol=1e-4) -> None:
    """Equal length, and every pair of tensors equal in dtype and shape and close in value."""
    assert len(actual) == len(expected), (len(actual), len(expected))
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype, (i, a.dtype, e.dtype)
        assert a.shape == e.shape, (i, a.shape, e.shape)
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, msg=f"output {i}")
