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


@pytest.fixture
def fake_cuda(monkeypatch):
    """One make-believe CUDA device whose random state is the dict returned ({"state": ...}):
    what seeding it and saving/restoring it (torch.random.fork_rng) do, without a GPU, to check
    that code which seeds the global random state leaves the CUDA one as it was."""
    import contextlib

    rng = {"state": "the caller's"}

    def seed(value):
        rng["state"] = f"seeded {value}"

    def set_state(state, device="cuda"):
        rng["state"] = state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": rng["state"])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "manual_seed", seed)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seed)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return rng
