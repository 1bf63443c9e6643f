"""Recurrent gate splits stay outside XNNPACK (a partitioning policy).

An LSTM or GRU cell, exported and unrolled over time, computes every step's
gates with one fully connected layer and then *splits* its result into the
gates (``chunk(4)`` for an LSTM, ``chunk(3)`` for a GRU), each gate going to a
sigmoid or tanh, directly or through an add / multiply with the other gate
vector::

    %g = addmm(%b, %h, %W)            %g = view_copy(addmm(%b, %h, %W), [1, 2, 192])
    %s = split_with_sizes_copy(%g, [64, 64, 64, 64], 2)     (or [64, 64, 64])
    %i = sigmoid(getitem(%s, 0))      %r = sigmoid(add(getitem(%s, 0), %x_r))
    %c = tanh(getitem(%s, 2))         %n = tanh(add(%x_n, mul(getitem(%s, 2), %r)))

Inside XNNPACK such a split is one ``StaticSlice`` node per gate, on a tiny
tensor (two rows of 64 floats), and an unrolled 2-layer net over 10 steps has
80-120 of them.  Measured on ExecuTorch 1.5.1's runtime (interleaved, medians of
9 x 150 calls), the delegate with those slices runs 1.10-1.15x slower than
ExecuTorch's program, which leaves the splits to the portable
``split_with_sizes_copy`` kernel (one call writes all gates) and so cuts the
net into one delegate per step; leaving the gate splits outside makes
lowerflow's LSTM and GRU programs take the same cut and run within 1-3% of it.

Only splits whose every piece reaches a ``sigmoid`` / ``tanh`` through at most
:data:`MAX_HOPS` elementwise ``add`` / ``mul`` / ``sub`` nodes are gate splits;
other splits (an attention block's q/k/v split goes to views and permutes) stay
in XNNPACK as before.

    before:  [ XNNPACK: ... FC -> Slice x4 -> Sigmoid/Tanh -> ... FC -> Slice x4 -> ... ]  (one delegate)
    after:   [ XNNPACK: ... FC ] -> split_with_sizes_copy -> [ XNNPACK: Sigmoid/Tanh ... FC ] -> ...
"""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten

SPLITS = (aten.split_with_sizes_copy.default, aten.split_copy.Tensor)
GATES = (aten.sigmoid.default, aten.tanh.default)
ELEMENTWISE = (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor)
#: Elementwise nodes allowed between a gate piece and its activation (a GRU's new gate: add(x_n, mul(h_n, r))).
MAX_HOPS = 2


def is_gate_split(node: torch.fx.Node) -> bool:
    """Whether ``node`` splits a recurrent cell's gates (every piece feeds a sigmoid / tanh)."""
    if node.op != "call_function" or node.target not in SPLITS:
        return False
    pieces = list(node.users)
    if len(pieces) < 2 or any(p.target is not operator.getitem for p in pieces):
        return False
    return all(p.users and all(_reaches_gate(u, MAX_HOPS) for u in p.users) for p in pieces)


def _reaches_gate(node: torch.fx.Node, hops: int) -> bool:
    if node.op != "call_function":
        return False
    if node.target in GATES:
        return True
    if node.target not in ELEMENTWISE or hops == 0 or not node.users:
        return False
    return all(_reaches_gate(u, hops - 1) for u in node.users)
