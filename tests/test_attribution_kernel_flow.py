"""kernel_flow.flow_logits: the kernel's gradient flow of the cross-entropy, against plain
gradient descent with small steps written out here (training logits and other inputs' logits
through the cross kernel); the stopping rule (share of the kernel's directions fitted, loss
floor); bad input."""

import pytest
import torch
from torch.nn import functional as F

from attribution import kernel_flow
from attribution.kernel_flow import flow_logits

O = 3


def _points():
    """Three Gaussian clusters of ten 2-d points, labelled by cluster."""
    torch.manual_seed(0)
    y = torch.arange(30) % O
    return 2 * torch.randn(O, 2, dtype=torch.float64)[y] + 0.8 * torch.randn(
        30, 2, dtype=torch.float64
    )


@pytest.fixture(scope="module")
def clusters():
    x = _points()
    return torch.exp(-(torch.cdist(x, x) ** 2) / 2), torch.arange(30) % O


def _share(f, time, eigenvalues):
    """(1/N) Σ_k (1 − exp(−t γ̄ e_k)), γ̄ the mean over examples of Σ_o p_o (1 − p_o)."""
    p = f.softmax(1)
    return (1 - torch.exp(-time * (p * (1 - p)).sum(1).mean() * eigenvalues)).mean().item()


def _gradient_descent(kernel, y, share, cross=None):
    """Euler steps of df/dt = −(k/N)(softmax(f) − Y) at 1 % of the stable step, the last one cut
    where the share of directions fitted meets `share`; with `cross` [M, N], also the logits
    f_z moved by the same steps through k(z, X)/N."""
    k = kernel / len(y)
    eigenvalues = torch.linalg.eigvalsh(k)
    eta = 0.01 / eigenvalues[-1].item()
    f, onehot, time = torch.zeros(len(y), O, dtype=torch.float64), F.one_hot(y, O).double(), 0.0
    kz = torch.zeros(0, len(y), dtype=torch.float64) if cross is None else cross / len(y)
    fz = torch.zeros(len(kz), O, dtype=torch.float64)
    while True:
        residual = f.softmax(1) - onehot
        new, new_z = f - eta * k @ residual, fz - eta * kz @ residual
        before, after = _share(f, time, eigenvalues), _share(new, time + eta, eigenvalues)
        if after >= share:
            cut = (share - before) / (after - before)
            return f + cut * (new - f), fz + cut * (new_z - fz)
        f, fz, time = new, new_z, time + eta


@pytest.mark.parametrize("share", [0.05, 0.1, 0.15])
def test_flow_follows_gradient_descent_to_the_share(clusters, share):
    kernel, y = clusters
    got = flow_logits(kernel, y, O, share).train
    expected, _ = _gradient_descent(kernel, y, share)
    assert (got - expected).norm() / expected.norm() < 0.01  # 0.36–0.53 % measured
    assert 0.1 < F.cross_entropy(got, y).item() < 1.0  # neither the start nor fitted


@pytest.mark.parametrize("share", [0.05, 0.15])
def test_other_inputs_follow_the_same_flow(clusters, share):
    """Logits of inputs outside the training set (the cross kernel of held-out points, and of the
    training points themselves, which must reproduce the training logits)."""
    kernel, y = clusters
    torch.manual_seed(1)
    z = 2 * torch.randn(7, 2, dtype=torch.float64)
    x = _points()
    cross = torch.exp(-(torch.cdist(z, x) ** 2) / 2)
    state = flow_logits(kernel, y, O, share, cross=cross)
    _, expected = _gradient_descent(kernel, y, share, cross)
    assert (state.test - expected).norm() / expected.norm() < 0.01  # 0.33–0.52 % measured
    assert state.test.shape == (7, O)
    itself = flow_logits(kernel, y, O, share, cross=kernel)
    torch.testing.assert_close(itself.test, itself.train, rtol=1e-9, atol=1e-9)
    assert flow_logits(kernel, y, O, share).test is None


def test_coarse_steps_leave_the_flow(clusters, monkeypatch):
    """The tolerance above is tight enough to see a coarser integration: faster-growing steps
    (step_growth), or a first step at 10 % of the stable step (the flow's time runs ahead)."""
    kernel, y = clusters
    expected, _ = _gradient_descent(kernel, y, 0.1)
    coarse = flow_logits(kernel, y, O, 0.1, step_growth=1.5).train
    assert (coarse - expected).norm() / expected.norm() > 0.01
    monkeypatch.setattr(kernel_flow, "FIRST_STEP", 0.1)
    got = flow_logits(kernel, y, O, 0.1).train
    assert (got - expected).norm() / expected.norm() > 0.01


def test_the_loss_floor_stops_the_flow_first(clusters):
    """A share beyond the flow's reach (it levels off once the labels are fitted) stops at the
    floor; a floor below the loss at the share changes nothing."""
    kernel, y = clusters
    floored = flow_logits(kernel, y, O, 0.5, loss_floor=0.05).train
    assert F.cross_entropy(floored, y).item() == pytest.approx(0.05, rel=1e-6)
    torch.testing.assert_close(
        flow_logits(kernel, y, O, 0.1, loss_floor=0.01).train, flow_logits(kernel, y, O, 0.1).train
    )


def test_a_share_out_of_reach_runs_max_steps(clusters, monkeypatch):
    kernel, y = clusters
    monkeypatch.setattr(kernel_flow, "MAX_STEPS", 10)
    short = flow_logits(kernel, y, O, 0.5).train  # stops after MAX_STEPS with the state it reached
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
    for cross in (kernel[:, :5], kernel[0]):
        with pytest.raises(ValueError, match=r"cross must be \[M, N\]"):
            flow_logits(kernel, y, O, 0.1, cross=cross)
    # NaN failed in torch's eigh ("failed to converge"), one output in 1 − 1/O (division by
    # zero); an indefinite kernel's training logits read its negative eigenvalues as 0 and its
    # cross logits as they are (5.6 % apart for λmin ≈ −5 % λmax)
    nan = kernel.clone()
    nan[0, 1] = nan[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^kernel contains non-finite values \(NaN or inf\)"):
        flow_logits(nan, y, O, 0.1)
    with pytest.raises(ValueError, match="^cross contains non-finite"):
        flow_logits(kernel, y, O, 0.1, cross=nan[:3])
    with pytest.raises(ValueError, match="num_outputs must be at least 2"):
        flow_logits(kernel, torch.zeros_like(y), 1, 0.1)
    shifted = kernel - 0.05 * torch.linalg.eigvalsh(kernel)[-1] * torch.eye(len(kernel))
    with pytest.raises(ValueError, match="kernel must be positive semidefinite"):
        flow_logits(shifted, y, O, 0.1)


def test_a_zero_kernel_leaves_the_flow_at_zero():
    """Along a kernel that is zero everywhere (no trainable parameter moves the outputs) the flow
    never moves; its first step was 1e300-long and its logits NaN, so `influence` failed in
    torch's eigh ("failed to converge") instead of naming the zero curvature, wherever the
    network's loss lay above log O (the flow's loss at f = 0), so that the flow started."""
    import attribution
    from attribution.damping import ZeroCurvature

    y = torch.tensor([0, 1, 2, 0, 1, 2])
    state = flow_logits(torch.zeros(6, 6), y, 3, loss_floor=0.1, cross=torch.zeros(2, 6))
    assert torch.equal(state.train, torch.zeros(6, 3)) and torch.equal(
        state.test, torch.zeros(2, 3)
    )
    net = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.fill_(-1.0)  # every ReLU off
        net[2].bias.copy_(torch.tensor([2.0, -1.0, 0.0]))  # a loss above log 3 on these labels
    net[2].bias.requires_grad_(False)
    x = torch.randn(6, 4)
    with pytest.raises(ZeroCurvature, match="no trainable parameter moves the outputs"):
        attribution.influence(net.eval(), x, y, x[:2])


def test_a_batch_of_flows_runs_each_as_if_alone(clusters):
    """Kernels [B, N, N] run in lockstep: each flow stops at its own step (different kernels,
    labels and cross kernels; one kernel zero, which never moves) with the state it reaches
    alone."""
    kernel, y = clusters
    x = _points()
    torch.manual_seed(2)
    z = 2 * torch.randn(5, 2, dtype=torch.float64)
    kernels = torch.stack([kernel, torch.exp(-(torch.cdist(x, x) ** 2) / 8), 0 * kernel])
    labels = torch.stack([y, y.roll(1), y])
    crosses = torch.stack([torch.exp(-(torch.cdist(z, x) ** 2) / width) for width in (2, 8, 2)])
    crosses[2] = 0
    batch = flow_logits(kernels, labels, O, 0.15, loss_floor=0.3, cross=crosses)
    assert batch.train.shape == (3, 30, O) and batch.test.shape == (3, 5, O)
    for k, yk, ck, train, test in zip(kernels, labels, crosses, batch.train, batch.test):
        alone = flow_logits(k, yk, O, 0.15, loss_floor=0.3, cross=ck)
        torch.testing.assert_close(train, alone.train, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(test, alone.test, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(batch.train[0], batch.train[1])
    assert torch.equal(batch.train[2], torch.zeros(30, O, dtype=torch.float64))


def test_bad_step_growth_and_batch_shapes(clusters):
    kernel, y = clusters
    for growth in (1.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match="step_growth must be > 1"):
            flow_logits(kernel, y, O, 0.1, step_growth=growth)
    with pytest.raises(ValueError, match=r"\[B, N, N\] and \[B, N\]"):
        flow_logits(torch.stack([kernel, kernel]), y, O, 0.1)
