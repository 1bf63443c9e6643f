"""Models used only by the orchestration tests."""

import torch

from examples.models import MLP, mlp


class MLPWithHead(MLP):
    """The demo MLP (same weights) followed by an op the reference backend does not take:
    its delegated partition is identical to the plain MLP's."""

    def forward(self, x):
        return torch.sin(super().forward(x))


def mlp_with_head():
    model, inputs = mlp()
    head = MLPWithHead().eval()
    head.load_state_dict(model.state_dict())
    return head, inputs
