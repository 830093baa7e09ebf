"""`ntk nas`: rank candidate architectures with an NTK proxy (default: a small demo space)."""

from __future__ import annotations

import warnings
from functools import partial

import click

from .choices import DEFAULT_RANKING, PROXY_METRICS, RANKING_BATCH_SIZE, RANKING_REPEATS
from .common import (
    DEVICE_OPTION,
    UsageProblem,
    check_paths,
    emit,
    flag_names,
    in_model_dtype,
    interactive,
    load_arrays,
    load_object,
    load_output_fn,
    model_files,
    output_options,
    spec_file,
    untrained_note,
)


def demo_space() -> dict:
    """Six ReLU MLPs of varied width and depth for digits: the candidates when none are given."""
    from ntk import demo

    return {
        f"mlp-{width}x{depth}": partial(demo.mlp, width, depth)
        for width, depth in ((8, 1), (64, 1), (256, 1), (16, 4), (64, 2), (128, 3))
    }


@click.command()
@click.option(
    "--candidates",
    "spec",
    default=None,
    help="package.module:attr or path/file.py:attr naming a dict of name -> factory or "
    "nn.Module (default: a built-in space of six MLPs)",
)
@click.option(
    "--data",
    default="digits",
    show_default=True,
    help="'digits' or an .npz/.pt file with arrays x and y (integer class labels, read only by "
    "the metrics that use labels)",
)
@click.option(
    "--metric",
    "metrics",
    type=click.Choice(PROXY_METRICS),
    multiple=True,
    help=f"proxy to rank by; repeat it to rank by the mean rank over several proxies "
    f"(default: the vote of {' and '.join(DEFAULT_RANKING)})",
)
@click.option(
    "--kind",
    type=click.Choice(["sum_logits", "trace", "lpntk"]),
    default="sum_logits",
    show_default=True,
    help="kernel kind of the kernel metrics (label_condition always reads the lpNTK)",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=2),
    default=RANKING_BATCH_SIZE,
    show_default=True,
    help="samples scored per repeat",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=RANKING_REPEATS,
    show_default=True,
    help="random batches and initialisations averaged",
)
@click.option(
    "--warmup-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Adam steps on a copy of each candidate before scoring",
)
@click.option("--seed", type=int, default=0, show_default=True)
@DEVICE_OPTION
@click.option(
    "--output-fn",
    default=None,
    help="map each candidate's output to logits: a field name (logits: an attribute or a "
    "dict key), "
    "package.module:function or path/file.py:function",
)
@output_options(
    lambda params: columns(params["metrics"]),
    "rank, candidate, the --metric names, mean_rank (several --metric), std (one --metric), "
    "kappa (--metric condition_number or label_condition) and seconds, e.g. "
    "candidate,mean_rank",
)
def nas(spec, data, metrics, kind, batch_size, repeats, warmup_steps, seed, device, output_fn, out):
    """Rank candidate architectures by NTK and zero-cost proxies (higher is better), best first."""
    from ntk import demo, proxies
    from ntk.core import inputs

    check_paths(
        [("--output", out.path)],
        [("--candidates", spec_file(spec)), *model_files(None, None, data, output_fn=output_fn)],
    )
    candidates = demo_space() if spec is None else load_object(spec, "candidates")
    if not isinstance(candidates, dict):
        raise UsageProblem(
            f"--candidates: {spec} is a {type(candidates).__name__}, not a dict of "
            "name -> factory or module"
        )
    if data == "digits":
        d = demo.digits()
        x, y = d.x_train, d.y_train
    else:
        x, y = load_arrays(data)
        x = in_model_dtype(None, x, "data")  # the candidates are built in torch's default dtype
    untrained_note(None, None)  # the warnings kept until the inputs are loaded
    metrics = list(metrics or DEFAULT_RANKING)
    # a vote member undefined for some candidate is left out; the table says why
    with warnings.catch_warnings(record=True) as caught, flag_names(x="--data's x", y="--data's y"):
        warnings.simplefilter("always")
        ranked = proxies.rank(
            candidates,
            x,
            y,
            metric=metrics,
            kind=kind,
            batch_size=batch_size,
            repeats=repeats,
            warmup_steps=warmup_steps,
            seed=seed,
            device=device,
            output_fn=load_output_fn(output_fn),
            progress=interactive(),
            return_details=True,
        )
    dropped = []
    for w in caught:
        if issubclass(w.category, proxies.VoteMemberDroppedWarning):
            dropped.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    rows = [
        {"rank": position, "candidate": name, **_columns(s), "seconds": round(s.seconds, 4)}
        for position, (name, s) in zip(_tied_positions([s.value for _, s in ranked]), ranked)
    ]
    used_batch = min(batch_size, inputs.count(x))  # every sample when there are fewer
    first = ranked[0][1]
    used = list(first.parts) if first.parts is not None else [first.metric]
    metrics, label = used, " + ".join(used)
    undefined = sorted({k for r in rows for k, v in r.items() if v is None and k in PROXY_METRICS})
    notes = [
        "↑ higher is better; the rank column orders the candidates, 1 = best",
        *(
            [f"mean_rank ↑: the mean of each proxy's rank (1 = worst, {len(rows)} = best)"]
            if len(metrics) > 1 and len(rows) > 1
            else []
        ),
        *(
            [f"– undefined ({', '.join(undefined)}: e.g. the log det of a singular matrix)"]
            if undefined
            else []
        ),
        *(
            [
                f"tse: −(mean loss) of {proxies.TSE_STEPS} Adam steps on minibatches of "
                f"{proxies.TRAINING_BATCH} from all of the data (--batch-size does not apply to it)"
            ]
            if "tse" in metrics
            else []
        ),
        *dropped,
    ]
    scored = (
        f"{proxies.TSE_STEPS} training steps"
        if set(metrics) <= set(proxies.TRAINING_METRICS)
        else f"{used_batch} samples"
    )
    emit(
        rows,
        out,
        title=f"{label} ({repeats} × {scored}, higher is better)",
        meta={
            "metric": metrics if len(metrics) > 1 else metrics[0],
            "kind": kind,
            "repeats": repeats,
            "batch_size": used_batch,
            "warmup_steps": warmup_steps,
        },
        headers={
            "mean_rank": "mean_rank ↑",
            "kappa": "κ (lower better)",
            **{m: f"{m} ↑" for m in PROXY_METRICS},
        },
        notes=notes,
    )


# The metrics whose rows also give κ itself (column kappa).
KAPPA_METRICS = ("condition_number", "label_condition")


def _tied_positions(values: list[float]) -> list[int]:
    """Positions 1, 2, … of values sorted best first, equal values sharing the first one's
    (competition ranking: 1, 2, 2, 4)."""
    positions: list[int] = []
    for i, value in enumerate(values):
        tied = i > 0 and value == values[i - 1]
        positions.append(positions[-1] if tied else i + 1)
    return positions


def columns(metrics) -> tuple[str, ...]:
    """The columns of a ranking by `metrics` (--metric; none: the default vote), known before
    any work (a vote member that `proxies.rank` leaves out has no column then)."""
    metrics = list(dict.fromkeys(metrics or DEFAULT_RANKING))
    if len(metrics) > 1:
        scores = ("mean_rank", *metrics)
    else:
        scores = (metrics[0], "std", *(("kappa",) if metrics[0] in KAPPA_METRICS else ()))
    return ("rank", "candidate", *scores, "seconds")


def _columns(s) -> dict:
    """A score's columns: value and spread (and κ), or the mean rank and each voter's value;
    -inf or NaN (an undefined score, e.g. naswot's log det of a singular kernel) as None."""
    import numpy as np

    if s.parts is not None:
        row = {"mean_rank": s.value, **{m: p.value for m, p in s.parts.items()}}
    else:
        row = {s.metric: s.value, "std": s.std}
        if s.metric in KAPPA_METRICS:
            row["kappa"] = float(np.mean(s.raw))
    return {k: None if v == float("-inf") or v != v else v for k, v in row.items()}
