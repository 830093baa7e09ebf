"""`ntk nas`: rank candidate architectures with an NTK proxy (default: a small demo space)."""
from __future__ import annotations

from functools import partial

import click
import torch

from ntk import demo, proxies

from .common import FORMATS, UsageProblem, emit, interactive, load_arrays, load_object


def demo_space() -> dict:
    """Six ReLU MLPs of varied width and depth for digits: the candidates when none are given."""
    return {f"mlp-{width}x{depth}": partial(demo.mlp, width, depth)
            for width, depth in ((8, 1), (64, 1), (256, 1), (16, 4), (64, 2), (128, 3))}


@click.command()
@click.option("--candidates", "spec", default=None,
              help="package.module:attr or path/file.py:attr naming a dict of name -> factory or "
                   "nn.Module (default: a built-in space of six MLPs)")
@click.option("--data", default="digits", show_default=True,
              help="'digits' or an .npz/.pt file with arrays x and y (integer class labels)")
@click.option("--metric", type=click.Choice(proxies.METRICS), default="lga", show_default=True)
@click.option("--kind", type=click.Choice(["sum_logits", "trace"]), default="sum_logits",
              show_default=True, help="kernel kind of the kernel metrics")
@click.option("--batch-size", type=click.IntRange(min=2), default=64, show_default=True,
              help="samples scored per repeat")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="random batches and initialisations averaged")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="Adam steps on a copy of each candidate before scoring")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="torch device, e.g. cpu or cuda")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--output", default=None, help="write the result to this file instead of stdout")
def nas(spec, data, metric, kind, batch_size, repeats, warmup_steps, seed, device, fmt, output):
    """Rank candidate architectures by an NTK proxy (higher is better), best first."""
    candidates = demo_space() if spec is None else load_object(spec, "candidates")
    if not isinstance(candidates, dict):
        raise UsageProblem(f"--candidates: {spec} is a {type(candidates).__name__}, not a dict of "
                           "name -> factory or module")
    if data == "digits":
        d = demo.digits()
        x, y = d.x_train, d.y_train
    else:
        x, y = load_arrays(data)
    ranked = proxies.rank(candidates, x, y, metric=metric, kind=kind, batch_size=batch_size,
                          repeats=repeats, warmup_steps=warmup_steps, seed=seed, device=device,
                          progress=interactive(), return_details=True)
    rows = []
    for position, (name, s) in enumerate(ranked, 1):
        row = {"rank": position, "candidate": name, metric: s.value, "std": s.std}
        if metric == "condition_number":
            row["kappa"] = float(torch.tensor(s.raw).mean())
        rows.append({**row, "seconds": round(s.seconds, 4)})
    emit(rows, fmt, output, title=f"{metric} proxy ({repeats} × {batch_size} samples, higher is better)",
         meta={"metric": metric, "kind": kind, "repeats": repeats, "batch_size": batch_size,
               "warmup_steps": warmup_steps})
