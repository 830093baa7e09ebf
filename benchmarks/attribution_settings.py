"""LDS of every influence method and of the peer libraries on four settings, in one run.

Settings (benchmarks/settings.py): digits MLP 64-64-10, digits CNN, breast_cancer and wine MLPs;
each with its trained network and LDS ground truth (half-subsets × seeds retrained with the
network's recipe, test margins averaged over seeds; cached under --cache-dir). Every method scores
the same network (seed 0; ensembles: seeds 0..9) on the same subsets. Peers (kronfluence EK-FAC /
K-FAC, dattri's explicit IF, TRAK, Grad-Dot) run in their own interpreter (--peer-python or
$NTK_PEER_PYTHON) by benchmarks/peers/attr_peers.py, exchanging weights, data and scores by files.

Run:   python benchmarks/attribution_settings.py --cache-dir /tmp/ntk-attr-cache
Smoke: python benchmarks/attribution_settings.py --smoke --no-peers
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from attribution import influence, lds, trak  # noqa: E402
from benchmarks import settings  # noqa: E402

ENSEMBLE = 10


def ours(setting: settings.Setting, smoke: bool) -> dict:
    """Our methods: name -> callable returning scores [N_test, N_train]."""
    model, x, y, xt, yt = setting.model, setting.x, setting.y, setting.xt, setting.yt
    count = 2 if smoke else ENSEMBLE
    nets = setting.models(count)
    return {
        "influence auto (gauss_newton, trace)": lambda: influence(model, x, y, xt, yt),
        "gauss_newton, trace, network's logits": lambda: influence(
            model, x, y, xt, yt, training_logits="network"
        ),
        "gauss_newton, full": lambda: influence(model, x, y, xt, yt, kind="full"),
        "grad_dot, full": lambda: influence(model, x, y, xt, yt, method="grad_dot"),
        **{
            f"gauss_newton, full, projected k={k}": (
                lambda k=k: influence(model, x, y, xt, yt, kind="full", dim=k)
            )
            for k in (1024, 2048, 4096)
        },
        "trak (ours), k=512": lambda: trak(model, x, y, xt, yt, dim=512),
        f"influence auto × {count} models": lambda: influence(
            model, x, y, xt, yt, checkpoints=nets
        ),
        f"gauss_newton, trace, network's logits × {count} models": lambda: influence(
            model, x, y, xt, yt, checkpoints=nets, training_logits="network"
        ),
        f"gauss_newton, full × {count} models": lambda: influence(
            model, x, y, xt, yt, kind="full", checkpoints=nets
        ),
        f"trak (ours), k=512 × {count} models": lambda: trak(
            model, x, y, xt, yt, dim=512, checkpoints=nets
        ),
    }


def run_peers(model, checkpoints, x, y, xt, yt, python: str, methods: str | None = None) -> dict:
    """Run benchmarks/peers/attr_peers.py in the peers' interpreter `python` on `model` (and
    `checkpoints`, a list of models for the ensemble methods); name -> (scores, seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.pt", Path(tmp) / "out.pt"
        torch.save(
            dict(
                model=model,
                checkpoints=[m.state_dict() for m in checkpoints],
                x=x,
                y=y,
                xt=xt,
                yt=yt,
            ),
            inp,
        )
        cmd = [python, str(HERE / "peers" / "attr_peers.py"), str(inp), str(out)]
        if methods:
            cmd += ["--methods", methods]
        # the repository on the peers' path: a network of a benchmark's own class unpickles
        paths = [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"peers failed:\n{proc.stderr[-3000:]}", flush=True)
        return torch.load(out, weights_only=False) if out.exists() else {}


def peers(setting: settings.Setting, python: str, methods: str | None, smoke: bool) -> dict:
    """The peers on a setting's network (ensembles: its first ENSEMBLE seeds)."""
    nets = setting.models(2 if smoke else ENSEMBLE)
    s = setting
    return run_peers(s.model, nets, s.x, s.y, s.xt, s.yt, python, methods)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(settings.NAMES))
    parser.add_argument("--subsets", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="where the ground truth is cached")
    parser.add_argument("--smoke", action="store_true", help="seconds-long miniature settings")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--peer-python", default=os.environ.get("NTK_PEER_PYTHON"))
    parser.add_argument("--peer-methods", default=None, help="comma-separated subset")
    parser.add_argument("--skip", default="", help="comma-separated substrings of our methods")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not args.no_peers and not args.peer_python:
        parser.error("give --peer-python (or $NTK_PEER_PYTHON), or --no-peers")
    skip = [s for s in args.skip.split(",") if s]
    table = []
    for name in args.settings.split(","):
        s = settings.load(
            name, subsets=args.subsets, seeds=args.seeds, cache_dir=args.cache_dir, smoke=args.smoke
        )
        print(
            f"\n## {name}: N_train {len(s.x)}, N_test {len(s.xt)}, test accuracy "
            f"{s.accuracy(s.model):.3f}; truth {s.subsets.shape[0]} half-subsets × "
            f"{args.seeds if not args.smoke else 1} seeds, seed noise {s.noise:.3f}\n",
            flush=True,
        )
        print("| method | LDS | time s |\n|---|---|---|")
        rows = {}
        for method, run in ours(s, args.smoke).items():
            if any(k in method for k in skip):
                continue
            start = time.perf_counter()
            scores = run()
            rows[method] = (lds(scores, s.subsets, s.truth), time.perf_counter() - start)
            print(f"| {method} | {rows[method][0]:.3f} | {rows[method][1]:.1f} |", flush=True)
        if not args.no_peers:
            for method, (scores, t) in peers(
                s, args.peer_python, args.peer_methods, args.smoke
            ).items():
                rows[method] = (lds(scores, s.subsets, s.truth), t)
                print(f"| {method} (peer) | {rows[method][0]:.3f} | {t:.1f} |", flush=True)
        auto = rows.get("influence auto (gauss_newton, trace)")
        for peer in ("kronfluence_ekfac", "kronfluence_kfac"):
            if auto and peer in rows:
                print(f"ratio LDS influence auto / {peer}: {auto[0] / rows[peer][0]:.2f}")
        table.append((name, rows))
    print("\n## LDS summary\n")
    names = list(dict.fromkeys(m for _, rows in table for m in rows))
    print("| method | " + " | ".join(n for n, _ in table) + " |")
    print("|---|" + "---|" * len(table))
    for m in names:
        cells = [f"{rows[m][0]:.3f}" if m in rows else "-" for _, rows in table]
        print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
