"""benchmarks/proxy_damping.py, the damping chosen per model by the LDS against the kernel flow
retrained on random halves: the proxy truth is the flows run one by one, the search keeps the best
λ it tries; halves that do not move are an error."""

import math
import sys
from pathlib import Path

import pytest
import torch

from attribution import lds, random_subsets
from attribution.kernel_flow import flow_logits
from attribution.outputs import margins

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import proxy_damping

O = 3
SHARE = 0.5


def _truth():
    """An RBF kernel of 24 training and 6 test points in three labelled clusters, and the proxy
    truth of its flows stopped at the loss 0.3 (or SHARE)."""
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(30) % O
    points = 2 * torch.randn(O, 2, generator=gen, dtype=torch.float64)[y]
    points += 0.8 * torch.randn(30, 2, generator=gen, dtype=torch.float64)
    k = torch.exp(-(torch.cdist(points, points) ** 2) / 2)
    kernel, cross, y, yt = k[:24, :24], k[24:, :24], y[:24], y[24:]
    truth = proxy_damping.proxy_truth(kernel, cross, y, yt, O, 0.3, SHARE, halves=8, seed=3)
    return kernel, cross, y, yt, truth


def test_the_proxy_truth_is_each_half_retrained_by_the_flow():
    """The batched flows give each half's test margins as `flow_logits` run on that half alone."""
    kernel, cross, y, yt, truth = _truth()
    assert torch.equal(truth.subsets, random_subsets(24, 8, seed=3))
    for mask, got in zip(truth.subsets, truth.margins):
        rows = mask.nonzero()[:, 0]
        alone = flow_logits(
            kernel[rows][:, rows],
            y[rows],
            O,
            SHARE,
            loss_floor=0.3,
            cross=cross[:, rows],
            step_growth=proxy_damping.PROXY_STEP_GROWTH,
        )
        torch.testing.assert_close(got, margins(alone.test, yt), rtol=1e-9, atol=1e-9)
    assert truth.margins.std(0).min() > 0  # the halves move every test margin


def test_the_search_keeps_the_best_lambda_it_tries():
    """A constructed landscape: the scores rank the truth's outputs less well the further λ is from
    λ* (on a log scale); the search returns λ* to within its finest ratio, the best of the λ it
    tried, after the coarse grid and two points per refinement."""
    gen = torch.Generator().manual_seed(0)
    subsets = random_subsets(40, 30, seed=1)
    signal = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    noise = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    truth = proxy_damping.ProxyTruth(subsets, subsets.double() @ signal.T)
    target, tried = 0.3, []

    def scores_at(lam):
        tried.append(lam)
        return signal + 0.4 * abs(math.log(lam / target)) * noise

    anchor = 2.0
    lam = proxy_damping.proxy_choice(scores_at, anchor, truth)
    finest = proxy_damping.REFINEMENTS[-1]
    assert target / finest < lam < target * finest
    coarse = len(proxy_damping.COARSE)
    assert tried[:coarse] == [anchor * c for c in proxy_damping.COARSE]
    assert len(tried) == len(set(tried)) <= coarse + 2 * len(proxy_damping.REFINEMENTS)
    best = max(set(tried), key=lambda t: lds(scores_at(t), subsets, truth.margins))
    assert lam == best


def test_halves_no_flow_moves_are_refused():
    """Halves whose flows all stop at the start (a loss floor above the loss at f = 0) leave every
    test margin at f = 0's, −log(O − 1): no λ can be chosen, and the error says why."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    kernel, y = z @ z.T, torch.arange(12) % O
    truth = proxy_damping.proxy_truth(kernel[:8, :8], kernel[8:, :8], y[:8], y[8:], O, 5.0, SHARE)
    torch.testing.assert_close(truth.margins, torch.full_like(truth.margins, -math.log(O - 1)))
    with pytest.raises(ValueError, match="leave every test margin constant"):
        proxy_damping.proxy_choice(lambda lam: torch.randn(4, 8, generator=gen), 1.0, truth)
