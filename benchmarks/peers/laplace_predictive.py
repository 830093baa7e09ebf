"""laplace-torch's predictive on a benchmark case (run by the peer venv that has laplace-torch;
its interpreter is passed to benchmarks/uncertainty.py by --peer-python or NTK_LAPLACE_PYTHON).

    $NTK_LAPLACE_PYTHON benchmarks/peers/laplace_predictive.py CASE.pt OUT.npz \
        --subset all --structure full [--tuning marglik|validation] [--repeats 3]

CASE.pt (written by benchmarks/uncertainty.py) holds the trained `model` (eval mode), x_train,
y_train, x_val, y_val and `eval`, a dict {name: inputs} of the sets to predict on. Each repeat
fits `Laplace(model, "classification", subset_of_weights, hessian_structure)`, tunes the prior
precision by its marginal likelihood (`optimize_prior_precision(method="marglik")`, the
library's recommended post-hoc recipe) or, with --tuning validation, by its grid search on the
validation NLL (`method="gridsearch"`), and predicts every set with the GLM predictive and the
probit link. OUT.npz holds the first repeat's probabilities (one array per set), the seconds of
each repeat and the peak resident-memory increase during the first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from laplace import Laplace
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the repository root: a case's model may be a class of the benchmarks (uncertainty.py's
# seq_conv is benchmarks.nas.spaces.ConvNet1d), which unpickling imports
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
from measure import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case")
    parser.add_argument("out")
    parser.add_argument("--subset", choices=("all", "last_layer"), default="all")
    parser.add_argument("--structure", choices=("full", "kron", "diag"), default="full")
    parser.add_argument("--tuning", choices=("marglik", "validation"), default="marglik")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow", type=float, default=60.0, help="do not repeat a slower run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    case = torch.load(args.case, weights_only=False)
    model = case["model"].eval()
    loader = DataLoader(TensorDataset(case["x_train"], case["y_train"]), batch_size=256)
    val = DataLoader(TensorDataset(case["x_val"], case["y_val"]), batch_size=256)

    def run() -> dict[str, np.ndarray]:
        la = Laplace(
            model,
            "classification",
            subset_of_weights=args.subset,
            hessian_structure=args.structure,
        )
        la.fit(loader)
        if args.tuning == "marglik":
            la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
        else:
            la.optimize_prior_precision(
                method="gridsearch", pred_type="glm", link_approx="probit", val_loader=val
            )
        with torch.no_grad():
            return {
                name: la(x, pred_type="glm", link_approx="probit").double().numpy()
                for name, x in case["eval"].items()
            }

    probs, seconds, peak = timed(run, args.repeats, slow=args.slow)
    np.savez(args.out, seconds=np.array(seconds), peak_bytes=peak, **probs)


if __name__ == "__main__":
    main()
