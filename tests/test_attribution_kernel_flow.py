"""kernel_flow.flow_logits: the kernel's gradient flow of the cross-entropy, against plain
gradient descent with small steps written out here; stopping at the target loss; bad input."""

import math

import pytest
import torch
from torch.nn import functional as F

from attribution import kernel_flow
from attribution.kernel_flow import flow_logits

O = 3


@pytest.fixture(scope="module")
def clusters():
    torch.manual_seed(0)
    y = torch.arange(30) % O
    x = 2 * torch.randn(O, 2, dtype=torch.float64)[y] + 0.8 * torch.randn(
        30, 2, dtype=torch.float64
    )
    return torch.exp(-(torch.cdist(x, x) ** 2) / 2), y


def _gradient_descent(kernel, y, target):
    """Euler steps of df/dt = −(k/N)(softmax(f) − Y) at 1 % of the stable step, the last one cut
    where the loss meets the target."""
    k = kernel / len(y)
    eta = 0.01 / torch.linalg.eigvalsh(k)[-1]
    f, onehot = torch.zeros(len(y), O, dtype=torch.float64), F.one_hot(y, O).double()
    while True:
        new = f - eta * k @ (f.softmax(1) - onehot)
        before, after = F.cross_entropy(f, y).item(), F.cross_entropy(new, y).item()
        if after <= target:
            return f + (before - target) / (before - after) * (new - f)
        f = new


@pytest.mark.parametrize("target", [0.6, 0.2, 0.05])
def test_flow_follows_gradient_descent_to_the_target_loss(clusters, target):
    kernel, y = clusters
    got = flow_logits(kernel, y, O, target)
    assert F.cross_entropy(got, y).item() == pytest.approx(target, rel=1e-9)
    expected = _gradient_descent(kernel, y, target)
    assert (got - expected).norm() / expected.norm() < 0.01  # 0.15–0.35 % measured


def test_coarse_steps_leave_the_flow(clusters, monkeypatch):
    """The tolerance above is tight enough to see a coarser integration."""
    kernel, y = clusters
    monkeypatch.setattr(kernel_flow, "STEP_GROWTH", 1.5)
    got = flow_logits(kernel, y, O, 0.05)
    expected = _gradient_descent(kernel, y, 0.05)
    assert (got - expected).norm() / expected.norm() > 0.01


def test_targets_at_the_start_or_out_of_reach(clusters, monkeypatch):
    kernel, y = clusters
    assert flow_logits(kernel, y, O, math.log(O)).abs().max() == 0  # the loss at f = 0
    monkeypatch.setattr(kernel_flow, "MAX_STEPS", 10)
    short = flow_logits(kernel, y, O, 1e-6)  # stops after MAX_STEPS with the loss it reached
    assert 1e-6 < F.cross_entropy(short, y).item() < math.log(O)


def test_bad_input(clusters):
    kernel, y = clusters
    with pytest.raises(ValueError, match="target_loss"):
        flow_logits(kernel, y, O, 0.0)
    with pytest.raises(ValueError, match=r"\[N, N\]"):
        flow_logits(kernel[:5], y, O, 0.1)
    with pytest.raises(ValueError, match=r"\[N, N\]"):
        flow_logits(kernel, y[:5], O, 0.1)
