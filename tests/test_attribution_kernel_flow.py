"""kernel_flow.flow_logits: the kernel's gradient flow of the cross-entropy, against plain
gradient descent with small steps written out here; the stopping rule (share of the kernel's
directions fitted, loss floor); bad input."""

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


def _share(f, time, eigenvalues):
    """(1/N) Σ_k (1 − exp(−t γ̄ e_k)), γ̄ the mean over examples of Σ_o p_o (1 − p_o)."""
    p = f.softmax(1)
    return (1 - torch.exp(-time * (p * (1 - p)).sum(1).mean() * eigenvalues)).mean().item()


def _gradient_descent(kernel, y, share):
    """Euler steps of df/dt = −(k/N)(softmax(f) − Y) at 1 % of the stable step, the last one cut
    where the share of directions fitted meets `share`."""
    k = kernel / len(y)
    eigenvalues = torch.linalg.eigvalsh(k)
    eta = 0.01 / eigenvalues[-1].item()
    f, onehot, time = torch.zeros(len(y), O, dtype=torch.float64), F.one_hot(y, O).double(), 0.0
    while True:
        new = f - eta * k @ (f.softmax(1) - onehot)
        before, after = _share(f, time, eigenvalues), _share(new, time + eta, eigenvalues)
        if after >= share:
            return f + (share - before) / (after - before) * (new - f)
        f, time = new, time + eta


@pytest.mark.parametrize("share", [0.05, 0.1, 0.15])
def test_flow_follows_gradient_descent_to_the_share(clusters, share):
    kernel, y = clusters
    got = flow_logits(kernel, y, O, share)
    expected = _gradient_descent(kernel, y, share)
    assert (got - expected).norm() / expected.norm() < 0.01  # 0.36–0.53 % measured
    assert 0.1 < F.cross_entropy(got, y).item() < 1.0  # neither the start nor fitted


def test_coarse_steps_leave_the_flow(clusters, monkeypatch):
    """The tolerance above is tight enough to see a coarser integration: faster-growing steps,
    or a first step at 10 % of the stable step (the flow's time runs ahead)."""
    kernel, y = clusters
    expected = _gradient_descent(kernel, y, 0.1)
    for constant, value in (("STEP_GROWTH", 1.5), ("FIRST_STEP", 0.1)):
        with monkeypatch.context() as patch:
            patch.setattr(kernel_flow, constant, value)
            got = flow_logits(kernel, y, O, 0.1)
        assert (got - expected).norm() / expected.norm() > 0.01


def test_the_loss_floor_stops_the_flow_first(clusters):
    """A share beyond the flow's reach (it levels off once the labels are fitted) stops at the
    floor; a floor below the loss at the share changes nothing."""
    kernel, y = clusters
    floored = flow_logits(kernel, y, O, 0.5, loss_floor=0.05)
    assert F.cross_entropy(floored, y).item() == pytest.approx(0.05, rel=1e-6)
    torch.testing.assert_close(
        flow_logits(kernel, y, O, 0.1, loss_floor=0.01), flow_logits(kernel, y, O, 0.1)
    )


def test_a_share_out_of_reach_runs_max_steps(clusters, monkeypatch):
    kernel, y = clusters
    monkeypatch.setattr(kernel_flow, "MAX_STEPS", 10)
    short = flow_logits(kernel, y, O, 0.5)  # stops after MAX_STEPS with the state it reached
    assert 0 < F.cross_entropy(short, y).item() < F.cross_entropy(0 * short, y).item()


def test_bad_input(clusters):
    kernel, y = clusters
    for share in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match="fitted_fraction"):
            flow_logits(kernel, y, O, share)
    with pytest.raises(ValueError, match="loss_floor"):
        flow_logits(kernel, y, O, 0.1, loss_floor=-1.0)
    with pytest.raises(ValueError, match=r"\[N, N\]"):
        flow_logits(kernel[:5], y, O, 0.1)
    with pytest.raises(ValueError, match=r"\[N, N\]"):
        flow_logits(kernel, y[:5], O, 0.1)
