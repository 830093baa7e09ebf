import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def small_classifier():
    """A 3-class MLP (float64; P = 8·6 + 6 + 6·3 + 3 = 75 > N·O = 60, so the exact posterior takes
    the kernel form) trained on 20 points: (model, x_train, y_train, x_test, y_test)."""
    from torch import nn

    from ntk import demo

    torch.manual_seed(0)
    x = torch.randn(28, 8, dtype=torch.float64)
    y = torch.arange(28) % 3
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model = demo.train(model, x[:20], y[:20], epochs=40, batch_size=10, lr=1e-2)
    return model, x[:20], y[:20], x[20:], y[20:]
