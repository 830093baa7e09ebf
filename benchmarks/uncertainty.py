"""Calibration and out-of-distribution detection of `attribution.NTKPosterior` against the MAP
softmax and laplace-torch, on the same trained networks in one run.

    python benchmarks/uncertainty.py [--peer-python PATH] [--settings a,b] [--repeats 3]
        [--methods a,b] [--peers a,b] [--splits 1]
    python benchmarks/uncertainty.py --smoke            # tiny data, ours only

Settings (trained here with `ntk.demo.train`, fixed seeds): `digits_mlp` (MLP 64-64-9) and
`digits_cnn` (two 3×3 convolutions) on scikit-learn's digits without the 9s, `breast_cancer`
(MLP 30-32-2 on standardised features). Each has a train, a validation and a test split (every
sample left after the other two).

Two held-out settings, `HELD_OUT_SETTINGS`, added after every uncertainty default was chosen and
never used to choose one (not in the default --settings; run them by naming them): `synth_mlp`,
the generated tabular data of benchmarks/nas/spaces.py (`synth_task`: 2,000 samples, 20
features, 5 classes, 3 % flipped labels; 1,000 train, 300 validation, 700 test) with the MLP
20-64-64-5 with LayerNorm and GELU (`SynthMLP(64, 1, "ln", "gelu", False)`); `seq_conv`, the
majority task of the same file (`majority_task(2000, 0)`: 16 one-hot tokens of 4, the label is
the most frequent; 1,000 / 300 / 700) with a residual 1-D CNN with GroupNorm
(`ConvNet1d(16, 2, 3, True, "gn", "relu", "mean")`).

The prior precision is the library default (no held-out data: the shape of a posterior keeping
many effective parameters, tempered to the size of one keeping few; chosen by
benchmarks/posterior_prior.py), the Laplace evidence (marginal likelihood),
or the NLL of the validation split, which the network did not train on
(`NTKPosterior.fit(validation=...)`; laplace-torch's gridsearch), both libraries on the same
split.

Out-of-distribution sets, made offline from the first OOD_SAMPLES test samples: digits — one
fixed pixel permutation, inverted intensities 1 − x, the held-out class 9; breast_cancer and
synth_mlp — one fixed feature permutation, negated rows, standard-normal noise rows; seq_conv —
two-hot sequences (a second, different token switched on at every position: the input leaves
the one-hot simplex but keeps its scale, and the majority is no longer defined), sequences with
a dominant token (one token written over 12 of the 16 positions, so it fills at least 12: a
valid one-hot sequence with an unambiguous label, yet a pattern the training split almost never
holds, about 1 random sequence in 7,000) and standard-normal noise of the same shape. A
permutation or negation of a one-hot sequence would not do: permuting positions keeps the label
and the distribution, and negation is as far off as noise.

With --splits K, each setting is run on K random splits (sample order, shifts and the network's
initialisation and training seeded by 0 … K−1; split 0 is the single run): a 15-bin ECE on
breast_cancer's 169 test samples moves by a few thousandths from one split to the next, so the
summary gives every method's means over the splits and the paired differences of the default to
each.

Metrics on the test split (`attribution.calibration_metrics`): accuracy, NLL, ECE (15 bins),
Brier (scikit-learn's); OOD AUROC of the predictive entropy (test = negative, shifted =
positive); fit + predict seconds (median of --repeats in a fresh process with one thread; a
first run over SLOW seconds is not repeated) and the peak resident-memory increase of the first
repeat. Methods: the MAP softmax (baseline), NTKPosterior (the default, EK-FAC curvature; K-FAC;
the exact curvature with kind full, trace or sum_logits, probit link, and full with the MC link;
"last layer": the exact posterior of a copy of the network whose other layers are frozen, the
counterpart of laplace-torch's last-layer Laplace), and laplace-torch
(interpreter from --peer-python or NTK_LAPLACE_PYTHON; all weights with a full or a Kronecker
Hessian, last layer with a Kronecker Hessian; GLM predictive, probit link;
benchmarks/peers/laplace_predictive.py). laplace-torch imports torchvision, which must match its
torch: a peer venv that works here is `pip install torch==2.14.1 torchvision==0.29.1
laplace-torch` (PyPI's torchvision beside the toolkit's torch 2.13.0 CPU wheel fails to import).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from scipy.stats import entropy
from scipy.stats import t as student_t
from sklearn.datasets import load_breast_cancer, load_digits, load_wine
from sklearn.metrics import roc_auc_score
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from measure import timed

from attribution import NTKPosterior, calibration_metrics
from benchmarks.nas.spaces import ConvNet1d, SynthMLP, majority_task, synth_task
from ntk import demo

SETTINGS = ("digits_mlp", "digits_cnn", "breast_cancer")
HELD_OUT_SETTINGS = ("synth_mlp", "seq_conv")  # never used to choose a default (docstring)
HELD_OUT_CLASS = 9  # digits: trained on 0–8, the 9s are one of the shifts
# Each shifted set is made from the first OOD_SAMPLES test samples (the held-out 9s: at most that
# many). The test split is every sample left after train and validation (digits 867,
# breast_cancer 169): on the first 300 only, 15-bin ECE differences of 0.01 were binning noise
# (digits CNN, NTKPosterior default: ECE 0.031 on 300 samples, 0.018 on all 867; MAP 0.018 and
# 0.019; results/uncertainty.md).
OOD_SAMPLES = 300
RECIPE = dict(epochs=300, batch_size=64, lr=3e-3, weight_decay=0.0)  # trained to convergence
DEFAULT = "NTKPosterior (default: EK-FAC)"
OURS = {  # name: (NTKPosterior settings, δ from the validation split); "subset" is ours
    DEFAULT: (dict(), False),
    "NTKPosterior kfac": (dict(curvature="kfac"), False),
    "NTKPosterior EK-FAC/validation": (dict(), True),
    "NTKPosterior exact": (dict(curvature="exact"), False),
    "NTKPosterior exact/evidence": (dict(curvature="exact", prior_precision="evidence"), False),
    "NTKPosterior exact/validation": (dict(curvature="exact"), True),
    "NTKPosterior exact/validation/MC link": (dict(curvature="exact", link="mc"), True),
    "NTKPosterior last layer": (dict(subset="last_layer", curvature="exact"), False),
    "NTKPosterior last layer/validation": (dict(subset="last_layer", curvature="exact"), True),
    "NTKPosterior trace/validation": (dict(kind="trace"), True),
    "NTKPosterior sum_logits/validation": (dict(kind="sum_logits"), True),
}
PEERS = {  # name: laplace_predictive.py arguments
    "laplace-torch all/full/marglik": ["--subset", "all", "--structure", "full"],
    "laplace-torch all/full/validation": ["--structure", "full", "--tuning", "validation"],
    "laplace-torch all/kron/validation": ["--structure", "kron", "--tuning", "validation"],
    "laplace-torch last-layer/kron/validation": [
        "--subset",
        "last_layer",
        "--structure",
        "kron",
        "--tuning",
        "validation",
    ],
}
BOOTSTRAP = 1000  # resamples of the paired intervals against the MAP
REFERENCE = "laplace-torch all/full/validation"  # the time ratios' denominator
SLOW = 60.0  # seconds: a first run slower than this is not repeated
PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "laplace_predictive.py"


def build(setting: str, split: int = 0) -> nn.Module:
    """The untrained architecture of a setting, initialised from the seed `split`."""
    torch.manual_seed(split)
    if setting == "digits_mlp":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 9))
    if setting == "digits_cnn":
        return nn.Sequential(
            nn.Unflatten(1, (1, 8, 8)),
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 2 * 2, 9),
        )
    if setting == "breast_cancer":
        return nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2))
    if setting == "wine":  # used by benchmarks/posterior_prior.py
        return nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 3))
    if setting == "synth_mlp":  # a plain Sequential of the same layers: torch classes only
        return nn.Sequential(*SynthMLP(64, 1, "ln", "gelu", False))
    if setting == "seq_conv":
        return ConvNet1d(16, 2, 3, True, "gn", "relu", "mean")
    valid = ", ".join(SETTINGS + HELD_OUT_SETTINGS)
    raise ValueError(f"unknown setting {setting!r}; valid: {valid}")


def data(setting: str, smoke: bool = False, split: int = 0) -> dict[str, np.ndarray]:
    """float32 inputs and int64 labels: train and test splits and the shifted sets ood_*; `split`
    seeds the order of the samples (and the shifts' permutations)."""
    rng = np.random.default_rng(split)
    if setting.startswith("digits"):
        d = load_digits()
        x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
        held = x[y == HELD_OUT_CLASS]
        x, y = x[y != HELD_OUT_CLASS], y[y != HELD_OUT_CLASS]
        n_train, n_val = 600, 150
    elif setting in HELD_OUT_SETTINGS:  # generated: the same samples, ordered by `split`
        x, y = synth_task() if setting == "synth_mlp" else majority_task(2000, 0)
        x, y = x.numpy(), y.numpy()
        n_train, n_val = 1000, 300
    else:
        d = {"breast_cancer": load_breast_cancer, "wine": load_wine}[setting]()
        x, y = d.data.astype(np.float32), d.target.astype(np.int64)
        n_train, n_val = (300, 100) if setting == "breast_cancer" else (100, 30)
    order = rng.permutation(len(y))
    x, y = x[order], y[order]
    cap = 60 if smoke else OOD_SAMPLES
    n_train, n_val = (min(n_train, 120), min(n_val, 40)) if smoke else (n_train, n_val)
    rest = n_train + n_val
    out = dict(
        x_train=x[:n_train],
        y_train=y[:n_train],
        x_val=x[n_train:rest],
        y_val=y[n_train:rest],
        x_test=x[rest:][: cap if smoke else None],  # every sample left (smoke: `cap`)
        y_test=y[rest:][: cap if smoke else None],
    )
    tabular = not setting.startswith("digits") and setting != "seq_conv"
    if tabular:  # standardised by the training split's statistics
        mu, sd = out["x_train"].mean(0), out["x_train"].std(0) + 1e-6
        for split in ("x_train", "x_val", "x_test"):
            out[split] = (out[split] - mu) / sd
    test = out["x_test"][:cap]
    if setting.startswith("digits"):
        out["ood_permuted"] = test[:, rng.permutation(x.shape[1])]
        out["ood_inverted"] = 1.0 - test
        out["ood_held_out_class"] = held[:cap]
    elif tabular:
        out["ood_permuted"] = test[:, rng.permutation(x.shape[1])]
        out["ood_negated"] = -test
    else:  # one-hot sequences [n, vocabulary, length]
        out["ood_two_hot"], out["ood_dominant"] = one_hot_shifts(test, rng)
    if not setting.startswith("digits"):
        out["ood_noise"] = rng.standard_normal(test.shape).astype(np.float32)
    return {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in out.items()}


def one_hot_shifts(test: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Two shifted copies of one-hot sequences [n, vocabulary, length]: two-hot (a second,
    different token on at every position) and dominant (one random token written over 12 random
    positions)."""
    n, vocabulary, length = test.shape
    tokens = test.argmax(1)  # [n, length]
    second = (tokens + rng.integers(1, vocabulary, tokens.shape)) % vocabulary
    two_hot = test + np.eye(vocabulary, dtype=test.dtype)[second].transpose(0, 2, 1)
    dominant = tokens.copy()
    token = rng.integers(0, vocabulary, n)
    for i in range(n):
        dominant[i, rng.choice(length, 12, replace=False)] = token[i]
    return two_hot, np.eye(vocabulary, dtype=test.dtype)[dominant].transpose(0, 2, 1)


def make_case(setting: str, path: Path, smoke: bool, split: int = 0) -> dict:
    """Train the setting's network on the random split `split` and save the case file the
    workers read."""
    d = data(setting, smoke, split)
    x, y = torch.from_numpy(d["x_train"]), torch.from_numpy(d["y_train"])
    recipe = dict(RECIPE, epochs=20) if smoke else RECIPE
    model = demo.train(build(setting, split), x, y, **recipe, seed=split)
    sets = {"test": d["x_test"], **{k: v for k, v in d.items() if k.startswith("ood_")}}
    case = dict(
        model=model,
        x_train=x,
        y_train=y,
        x_val=torch.from_numpy(d["x_val"]),
        y_val=torch.from_numpy(d["y_val"]),
        y_test=d["y_test"],
        eval={k: torch.from_numpy(v) for k, v in sets.items()},
    )
    torch.save(case, path)
    return case


def last_layer(model: nn.Module) -> nn.Module:
    """A copy of `model` whose only trainable parameters are its last module's that has any (the
    eNTK over them: laplace-torch's subset_of_weights="last_layer" in function space)."""
    model = copy.deepcopy(model)
    last = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None][-1]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in last.parameters():
        p.requires_grad_(True)
    return model


def ours_worker(case_path: str, out: str, method: str, repeats: int) -> None:
    """One NTKPosterior variant on a case (run in a fresh process, one thread)."""
    torch.set_num_threads(1)
    case = torch.load(case_path, weights_only=False)

    settings, tuned = OURS[method]
    settings = dict(settings)
    subset = settings.pop("subset", "all")
    validation = (case["x_val"], case["y_val"]) if tuned else None

    def run() -> dict[str, np.ndarray]:
        model = last_layer(case["model"]) if subset == "last_layer" else case["model"]
        post = NTKPosterior(model, **settings)
        post.fit(case["x_train"], case["y_train"], validation=validation)
        return {name: post.predict_proba(x) for name, x in case["eval"].items()}

    probs, seconds, peak = timed(run, repeats, slow=SLOW)
    np.savez(out, seconds=np.array(seconds), peak_bytes=peak, **probs)


def run_worker(command: list[str], out: Path, timeout: float) -> dict | None:
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  timed out after {timeout:.0f} s: {' '.join(command[-6:])}")
        return None
    if proc.returncode != 0:
        print(f"  failed: {' '.join(command[-4:])}: {proc.stderr.strip().splitlines()[-1:]}")
        return None
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


def paired_interval(p, reference, y, metric: str, draws: int = BOOTSTRAP) -> str:
    """95 % interval of metric(p) − metric(reference) over `draws` bootstrap resamples of the
    test samples (the same resample for both), as text."""
    rng = np.random.default_rng(0)
    diffs = []
    for _ in range(draws):
        i = rng.integers(0, len(y), len(y))
        ours, theirs = calibration_metrics(p[i], y[i]), calibration_metrics(reference[i], y[i])
        diffs.append(ours[metric] - theirs[metric])
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return f"[{lo:+.4f}, {hi:+.4f}]"


def metrics(result: dict, y_test: np.ndarray, reference: np.ndarray | None = None) -> dict:
    """Test-split calibration metrics and OOD AUROCs of one method's probabilities (each row
    renormalised in float64: the peers return float32); with the MAP's test probabilities as
    `reference`, the paired-bootstrap 95 % intervals of the NLL and ECE differences to it."""
    result = {
        k: v / v.sum(1, keepdims=True) if k == "test" or k.startswith("ood_") else v
        for k, v in result.items()
    }
    p = result["test"]
    row = calibration_metrics(p, y_test)
    h_test = entropy(p, axis=1)
    for name in sorted(k for k in result if k.startswith("ood_")):
        h = entropy(result[name], axis=1)
        truth = np.r_[np.zeros(len(h_test)), np.ones(len(h))]
        row["auroc " + name[4:]] = float(roc_auc_score(truth, np.r_[h_test, h]))
    if reference is not None:
        for metric in ("nll", "ece"):
            row[f"Δ{metric} vs MAP, 95 % CI"] = paired_interval(p, reference, y_test, metric)
    if "seconds" in result:
        row["seconds"] = float(np.median(result["seconds"]))
        row["peak MiB"] = float(result["peak_bytes"]) / 2**20
    return row


def table(setting: str, rows: dict[str, dict]) -> str:
    columns = list(dict.fromkeys(c for row in rows.values() for c in row))
    columns = [c for c in columns if c not in ("seconds", "peak MiB")]
    columns += ["seconds", "× " + REFERENCE, "peak MiB"]
    ref = rows.get(REFERENCE, {}).get("seconds")
    lines = [f"### {setting}", "", "| method | " + " | ".join(columns) + " |"]
    lines.append("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        cells = []
        for c in columns:
            if c.startswith("×"):
                value = row["seconds"] / ref if ref and "seconds" in row else None
                cells.append("–" if value is None else f"{value:.2f}")
            else:
                value = row.get(c)
                if value is None:
                    cells.append("–")
                else:
                    cells.append(value if isinstance(value, str) else f"{value:.4g}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def split_summary(setting: str, per_split: list[dict[str, dict]]) -> str:
    """Each method's mean NLL, ECE and seconds over the splits and, for `DEFAULT`, the 95 %
    t-interval of its paired difference to that method with the number of splits where it is no
    worse."""
    methods = [m for m in per_split[0] if all(m in rows for rows in per_split)]
    lines = [
        f"### {setting}: means over {len(per_split)} splits; {DEFAULT} minus each method",
        "",
        "| method | NLL | ECE | seconds | Δ NLL, 95 % CI | no worse | Δ ECE, 95 % CI | no worse |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method in methods:
        means, paired = [], []
        for metric in ("nll", "ece"):
            values = np.array([rows[method][metric] for rows in per_split])
            means.append(f"{values.mean():.4f}")
            if metric == "ece":
                seconds = [rows[method].get("seconds") for rows in per_split]
                means.append("–" if None in seconds else f"{np.mean(seconds):.3g}")
            if DEFAULT not in methods or method == DEFAULT:
                paired += ["–", "–"]
                continue
            diff = np.array([rows[DEFAULT][metric] for rows in per_split]) - values
            half = student_t.ppf(0.975, len(diff) - 1) * diff.std(ddof=1) / np.sqrt(len(diff))
            paired.append(f"[{diff.mean() - half:+.4f}, {diff.mean() + half:+.4f}]")
            paired.append(f"{int((diff <= 0).sum())} / {len(diff)}")
        lines.append(f"| {method} | " + " | ".join(means + paired) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--methods", default=",".join(OURS), help="NTKPosterior variants")
    parser.add_argument("--peer-python", default=os.environ.get("NTK_LAPLACE_PYTHON"))
    parser.add_argument("--peers", default=",".join(PEERS), help="laplace-torch configurations")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny data, one repeat, no peers")
    parser.add_argument("--json", help="also write every number to this file")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per method (all its repeats)"
    )
    parser.add_argument(
        "--splits",
        type=int,
        default=1,
        help="random splits (sample order and initialisation seeds 0, 1, …) per setting; above 1, "
        "a summary of the metrics over splits follows the per-split tables",
    )
    parser.add_argument("--worker", nargs=3, metavar=("CASE", "OUT", "METHOD"), help="internal")
    args = parser.parse_args()
    if args.worker:
        ours_worker(*args.worker, repeats=args.repeats)
        return
    settings = args.settings.split(",")
    methods = args.methods.split(",")
    for name in settings:
        if name not in SETTINGS + HELD_OUT_SETTINGS:
            valid = ", ".join(SETTINGS + HELD_OUT_SETTINGS)
            parser.error(f"unknown setting {name!r}; valid: {valid}")
    for name in methods:
        if name not in OURS:
            parser.error(f"unknown method {name!r}; valid: {', '.join(OURS)}")
    peers = args.peers.split(",")
    for name in peers:
        if name not in PEERS:
            parser.error(f"unknown peer {name!r}; valid: {', '.join(PEERS)}")
    repeats = 1 if args.smoke else args.repeats
    peer = None if args.smoke else args.peer_python
    if peer is None and not args.smoke:
        print("no laplace-torch interpreter (--peer-python or NTK_LAPLACE_PYTHON): ours only")
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in settings:
            per_split = []
            for split in range(args.splits):
                case_path = Path(tmp) / f"{setting}-{split}.pt"
                case = make_case(setting, case_path, args.smoke, split)
                with torch.no_grad():
                    softmax = {
                        k: case["model"](x).double().softmax(-1).numpy()
                        for k, x in case["eval"].items()
                    }
                rows = {"MAP softmax": metrics(softmax, case["y_test"])}
                for i, method in enumerate(methods):
                    out = Path(tmp) / f"{setting}-{split}-ours-{i}.npz"
                    cmd = [sys.executable, __file__, "--repeats", str(repeats), "--worker"]
                    cmd += [str(case_path), str(out), method]
                    result = run_worker(cmd, out, args.timeout)
                    if result is not None:
                        rows[method] = metrics(result, case["y_test"], softmax["test"])
                for method in peers if peer else ():
                    out = Path(tmp) / f"{setting}-{split}-peer-{len(rows)}.npz"
                    cmd = [peer, str(PEER_SCRIPT), str(case_path), str(out), *PEERS[method]]
                    result = run_worker(cmd + ["--repeats", str(repeats)], out, args.timeout)
                    if result is not None:
                        rows[method] = metrics(result, case["y_test"], softmax["test"])
                per_split.append(rows)
                title = setting if args.splits == 1 else f"{setting}, split {split}"
                print(table(title, rows), flush=True)
                print()
            report[setting] = per_split[0] if args.splits == 1 else per_split
            if args.splits > 1:
                print(split_summary(setting, per_split), flush=True)
                print()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
