"""Kronfluence's EK-FAC (or K-FAC) pairwise influence on a benchmark case (run by the peer venv
that has kronfluence: its interpreter is passed to the driver by flag or environment variable).

    $KRONFLUENCE_PYTHON benchmarks/peers/kronfluence_scores.py CASE.pt OUT.npy \
        [--strategy ekfac] [--batch-size 512] [--damping heuristic]

CASE.pt (written by benchmarks/attribution_scale.py) holds the whole `model` (a torch.nn.Sequential
of standard modules, eval mode), x_train, y_train, x_test and y_test. The task is the one ours
attributes: the training loss is the summed cross-entropy (labels sampled from the model for the
true Fisher, Kronfluence's default) and the measurement the margin f = g_y − logsumexp_{j≠y} g_j.
--damping: Kronfluence's heuristic (0.1 × the mean eigenvalue of each module's factored
curvature; default), its ScoreArguments default, or a number. Kronfluence scores
g_fᵀ (G + λI)⁻¹ g_ℓ with the gradient of the training *loss*, so OUT.npy holds their negation
[N_test, N_train] (the effect of up-weighting a training example on the margin, our sign). Prints
one JSON object: seconds (factors and scores, in this process), the peak resident-memory increase
during them and the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from kronfluence.analyzer import Analyzer, prepare_model
from kronfluence.arguments import FactorArguments, ScoreArguments
from kronfluence.task import Task
from measure import PeakRSS


class Classification(Task):
    def compute_train_loss(self, batch, model, sample=False):
        x, y = batch
        logits = model(x)
        if sample:
            with torch.no_grad():
                y = torch.multinomial(logits.detach().softmax(-1), 1).flatten()
        return F.cross_entropy(logits, y, reduction="sum")

    def compute_measurement(self, batch, model):
        x, y = batch
        logits = model(x)
        correct = logits.gather(1, y[:, None]).squeeze(1)
        others = logits.scatter(1, y[:, None], float("-inf")).logsumexp(-1)
        return (correct - others).sum()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case")
    parser.add_argument("out")
    parser.add_argument("--strategy", default="ekfac", choices=["ekfac", "kfac"])
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--damping",
        default="heuristic",
        help="'heuristic' (Kronfluence's 0.1 × mean eigenvalue), 'default' (ScoreArguments' "
        "default) or a number",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    case = torch.load(args.case, weights_only=False)
    model = case["model"].eval()
    train = torch.utils.data.TensorDataset(case["x_train"], case["y_train"])
    test = torch.utils.data.TensorDataset(case["x_test"], case["y_test"])
    if args.damping == "default":
        score_args = ScoreArguments()
    else:
        score_args = ScoreArguments(
            damping_factor=None if args.damping == "heuristic" else float(args.damping)
        )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, PeakRSS() as mem:
        start = time.perf_counter()
        task = Classification()
        model = prepare_model(model, task)
        analyzer = Analyzer("bench", model, task, cpu=True, disable_tqdm=True, output_dir=tmp)
        analyzer.fit_all_factors(
            "factors",
            train,
            per_device_batch_size=args.batch_size,
            factor_args=FactorArguments(strategy=args.strategy),
        )
        analyzer.compute_pairwise_scores(
            "scores",
            "factors",
            test,
            train,
            per_device_query_batch_size=len(test),
            per_device_train_batch_size=args.batch_size,
            score_args=score_args,
        )
        scores = analyzer.load_pairwise_scores("scores")["all_modules"]
        seconds = time.perf_counter() - start
    np.save(args.out, -scores.double().numpy())
    print(
        json.dumps(
            {
                "seconds": seconds,
                "memory_increase": mem.increase,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
