"""The report's plots: matplotlib figures rendered to base64 PNG for embedding in HTML (`Figure`
objects, never pyplot, so no global state and no display are involved)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure


def png(fig: Figure) -> str:
    """The figure as a base64-encoded PNG (for `<img src="data:image/png;base64,...">`)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def faithfulness_scatter(network: np.ndarray, surrogate: np.ndarray, agree: np.ndarray) -> str:
    """Network probability vs surrogate probability of the same class, one point per test example;
    crosses where the two predict different classes."""
    fig = Figure(figsize=(4.6, 4.2))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="y = x")
    ax.scatter(network[agree], surrogate[agree], s=10, alpha=0.6, label="same prediction")
    if (~agree).any():
        ax.scatter(
            network[~agree],
            surrogate[~agree],
            s=28,
            marker="x",
            color="C3",
            label="different prediction",
        )
    ax.set(
        xlabel="network probability",
        ylabel="surrogate probability",
        xlim=(-0.02, 1.02),
        ylim=(-0.02, 1.02),
    )
    ax.legend(loc="upper left", fontsize=8)
    return png(fig)


def spectrum(eigenvalues: np.ndarray) -> str:
    """Eigenvalues λ_1 ≥ λ_2 ≥ … on a log scale (non-positive ones are not drawn)."""
    fig = Figure(figsize=(5.2, 3.4))
    ax = fig.add_subplot()
    positive = eigenvalues[eigenvalues > 0]
    ax.semilogy(np.arange(1, len(positive) + 1), positive, marker=".", ms=3, lw=1)
    ax.set(xlabel="index i", ylabel="eigenvalue λ_i", xscale="log")
    ax.grid(True, which="major", alpha=0.3)
    return png(fig)


def reliability_diagram(curves: dict[str, dict]) -> str:
    """Accuracy against mean confidence per confidence bin, one line per model ({name: the bins
    of `attribution.reliability`}), marker area ∝ the samples in the bin; the diagonal is
    perfect calibration."""
    fig = Figure(figsize=(4.6, 4.2))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="calibrated")
    for style, (name, bins) in zip(("-", "--", ":", "-."), curves.items()):
        count = np.asarray(bins["count"], dtype=float)
        ax.plot(bins["confidence"], bins["accuracy"], marker=".", lw=1.2, ls=style, label=name)
        ax.scatter(bins["confidence"], bins["accuracy"], s=200 * count / count.sum(), alpha=0.3)
    ax.set(xlabel="confidence (probability of the predicted class)", ylabel="accuracy")
    ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02))
    ax.legend(loc="upper left", fontsize=8)
    return png(fig)


def bar_chart(names: Sequence[str], values: Sequence[float], xlabel: str) -> Figure:
    """Horizontal bars, first name on top."""
    fig = Figure(figsize=(5.2, 0.45 * len(names) + 1.0))
    ax = fig.add_subplot()
    y = np.arange(len(names))
    ax.barh(y, values, color="C0")
    ax.set_yticks(y, labels=names)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def bars(names: Sequence[str], values: Sequence[float], xlabel: str) -> str:
    """`bar_chart` as a base64 PNG."""
    return png(bar_chart(names, values, xlabel))


def image_row(
    images: Sequence[np.ndarray], captions: Sequence[str], colors: Sequence[str] | None = None
) -> str:
    """Small images side by side with a caption under each (channel-first or grey images)."""
    fig = Figure(figsize=(1.05 * len(images), 1.55))
    for i, (image, caption) in enumerate(zip(images, captions)):
        ax = fig.add_subplot(1, len(images), i + 1)
        ax.imshow(_displayable(image), cmap="gray_r", interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_xlabel(caption, fontsize=7, color=(colors[i] if colors else "black"))
        if colors:
            for spine in ax.spines.values():
                spine.set(color=colors[i], linewidth=2)
    return png(fig)


def _displayable(image: np.ndarray) -> np.ndarray:
    """[H, W] as is; [C, H, W] with 1 or 3 channels as [H, W] or [H, W, 3] scaled to [0, 1]."""
    if image.ndim == 3:
        image = image[0] if image.shape[0] == 1 else np.moveaxis(image, 0, -1)
        if image.ndim == 3:
            lo, hi = image.min(), image.max()
            image = (image - lo) / (hi - lo) if hi > lo else np.zeros_like(image)
    return image
