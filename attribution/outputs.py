"""Network outputs and the margin f = g_y − logsumexp_{j≠y} g_j = log(p_y / (1 − p_y)) that TRAK
(Park et al., ICML 2023) and the linear datamodeling score attribute."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from ntk.core import inputs
from ntk.core.kinds import ONE_LOGIT, class_labels  # checked in the core: lpntk needs them too
from ntk.core.model import ModelView, check_module, check_output_rows, copy_module


def labels(y, n: int, num_outputs: int, name: str = "y") -> torch.Tensor:
    """Class labels [n] checked by the core (`class_labels`), on the CPU with the logits."""
    return class_labels(y, n, num_outputs, name).cpu()


def logits(
    model: nn.Module,
    x,
    *,
    output_fn: Callable | None = None,
    batch_size: int = 1024,
    name: str = "x",
) -> torch.Tensor:
    """Model outputs [N, O] in float64 on the CPU (where the attribution algebra runs), computed
    functionally on the model's device (the model is never modified); `name` names the inputs
    (x_train, x_test, ...) in errors."""
    view = ModelView(model, output_fn=output_fn)
    x = inputs.from_numpy(x, name, inputs.param_dtype(model))  # numpy arrays of floats
    n = inputs.validate(x, name)
    x = inputs.convert(x, view.device, None)
    out = []
    with torch.no_grad():
        for s in range(0, n, batch_size):
            block = view.forward_checked(inputs.take(x, slice(s, s + batch_size)), name)
            check_output_rows(block, min(batch_size, n - s), name)
            out.append(block)
    return torch.cat(out).to(device="cpu", dtype=torch.float64)


def train_test_logits(
    model: nn.Module, x_train, x_test, output_fn: Callable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` of x_train [N, O] and of x_test [M, O], refused when their O differ (most often
    one test sample passed without its sample axis: its features were taken as samples)."""
    g_train = logits(model, x_train, output_fn=output_fn, name="x_train")
    g_test = logits(model, x_test, output_fn=output_fn, name="x_test")
    check_num_outputs(g_test, g_train.shape[1], "x_test")
    _check_classes(g_train)  # before the labels, which a single output cannot index
    return g_train, g_test


def logits_like_training(
    model: nn.Module, x, x_train, num_outputs: int, *, output_fn=None, name: str = "x"
) -> torch.Tensor:
    """`logits` of x [M, O], inputs to be compared with the training inputs x_train: the same
    structure (type, dict keys, tuple length), per-sample shapes the model decides on (sequences
    of another length), and the training inputs' O = num_outputs outputs; run before any kernel
    of x, so that a failure names x (`name`)."""
    inputs.check_structure(x, x_train, (name, "x_train"))
    g = logits(model, x, output_fn=output_fn, name=name)
    check_num_outputs(g, num_outputs, name)
    return g


def check_num_outputs(g: torch.Tensor, num_outputs: int, name: str) -> None:
    """The logits g [M, O'] of `name` have the training inputs' O = num_outputs columns (a model
    may take inputs of another per-sample shape, such as a single sample without its sample
    axis, and give other outputs)."""
    if g.shape[1] != num_outputs:
        raise ValueError(
            f"the model gives {num_outputs} outputs per sample on x_train but {g.shape[1]} on "
            f"{name}; a single sample needs its sample axis ({name}[None])"
        )


def _check_classes(g: torch.Tensor) -> None:
    if g.shape[-1] < 2:
        raise ValueError(
            f"the margin needs a classifier with at least two outputs (class scores); the model "
            f"has {g.shape[-1]} output ({ONE_LOGIT})"
        )


def two_class_logits(output_fn: Callable | None, out) -> torch.Tensor:
    """The logits (0, z) [B, 2] of a binary classifier whose output (after `output_fn`) is one
    logit z per sample, [B] or [B, 1]: softmax((0, z)) = (1 − σ(z), σ(z)), class 1's margin z."""
    z = out if output_fn is None else output_fn(out)
    z = z.reshape(z.shape[0], 1)
    return torch.cat([torch.zeros_like(z), z], 1)


def margins(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """f = g_y − logsumexp_{j≠y} g_j for logits g [..., N, O] and labels y [N]."""
    _check_classes(g)
    y = y.expand(g.shape[:-1])
    correct = g.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    others = g.scatter(-1, y.unsqueeze(-1), float("-inf"))
    return correct - others.logsumexp(-1)


def margin_gradient(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """∂f/∂g [N, O]: +1 at y, −softmax of the other logits elsewhere."""
    _check_classes(g)
    others = g.scatter(-1, y.unsqueeze(-1), float("-inf")).softmax(-1)
    return (-others).scatter(-1, y.unsqueeze(-1), 1.0)


def softmax_curvature(g: torch.Tensor) -> torch.Tensor:
    """Λ = diag(p) − p pᵀ [N, O, O], the Hessian of cross-entropy with respect to the logits."""
    p = g.softmax(-1)
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)


def psd_root(a: torch.Tensor) -> torch.Tensor:
    """The symmetric square root A^½ [..., O, O] of positive semi-definite matrices (eigenvalues
    clamped at 0), e.g. S = Λ^½ of the softmax curvature."""
    evals, evecs = torch.linalg.eigh(a)
    return evecs @ torch.diag_embed(evals.clamp_min(0).sqrt()) @ evecs.transpose(-1, -2)


def psd_inverse_root(a: torch.Tensor) -> torch.Tensor:
    """The pseudo-inverse (A^½)⁺ [..., O, O] of the symmetric square root of positive
    semi-definite matrices: 0 along the directions without curvature, the eigenvalues within
    rounding of 0 (≤ O·ε times the largest of their matrix)."""
    evals, evecs = torch.linalg.eigh(a)
    floor = evals.amax(-1, keepdim=True) * a.shape[-1] * torch.finfo(evals.dtype).eps
    inverse = torch.where(evals > floor, evals, torch.inf).rsqrt()  # 1/√∞ = 0
    return evecs @ torch.diag_embed(inverse) @ evecs.transpose(-1, -2)


def models(model: nn.Module, checkpoints: Sequence | None) -> list[nn.Module]:
    """The models to average over: `model`, or copies of it holding each checkpoint's weights."""
    check_module(model)
    if checkpoints is None:
        return [model]
    if len(checkpoints) == 0:
        raise ValueError("checkpoints is empty; pass None to use the model alone")
    out = []
    for k, c in enumerate(checkpoints):
        if isinstance(c, nn.Module):
            _check_architecture(model, c, f"checkpoints[{k}]")
            out.append(c)
        elif isinstance(c, dict):
            copy_ = copy_module(model)
            try:
                copy_.load_state_dict(c)
            except RuntimeError as e:  # torch lists every mismatch after a header line
                detail = "; ".join(line.strip() for line in str(e).splitlines()[1:] if line.strip())
                raise ValueError(
                    f"checkpoints[{k}] does not fit the model: {detail or e}"
                ) from None
            out.append(copy_)
        else:
            raise TypeError(
                f"checkpoints must hold nn.Modules or state dicts, got {type(c).__name__}"
            )
    return out


def _check_architecture(model: nn.Module, other: nn.Module, name: str) -> None:
    """Refuse `other` unless its state dict has `model`'s names and shapes (what loading it as a
    state dict checks)."""
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in other.state_dict().items()}
    if ours == theirs:
        return
    problems = [f"missing {k}" for k in ours if k not in theirs]
    problems += [f"unexpected {k}" for k in theirs if k not in ours]
    problems += [
        f"{k} has shape {theirs[k]}, the model's {ours[k]}"
        for k in ours
        if k in theirs and ours[k] != theirs[k]
    ]
    raise ValueError(f"{name} is not a model of the model's architecture: {'; '.join(problems)}")


def predicted_labels(model: nn.Module, x_test, y_test, checkpoints, output_fn=None):
    """y_test, or — when it is None and several checkpoints are scored — `model`'s predicted
    labels, so that every checkpoint explains the margin of the same class."""
    if y_test is not None or checkpoints is None:
        return y_test
    return logits(model, x_test, output_fn=output_fn, name="x_test").argmax(1)


def test_labels(g_test: torch.Tensor, y_test) -> torch.Tensor:
    """Labels of the test margins: y_test, or the network's predictions when None."""
    if y_test is None:
        return g_test.argmax(1)
    return labels(y_test, g_test.shape[0], g_test.shape[1], "y_test")
