"""Peer attribution libraries on one model, run in their own interpreter (kronfluence + dattri):

    <peer-python> benchmarks/peers/attr_peers.py IN.pt OUT.pt [--methods a,b,...]

IN.pt (torch.save): model (a picklable nn.Module), checkpoints (list of state dicts for the
ensemble methods), x, y (training set), xt, yt (test set). OUT.pt: {method: (scores
[N_test, N_train] float64, seconds)}, every score oriented as "the effect of including training
example i on the test margin f = g_y − logsumexp_{j≠y} g_j" (positive = helps), as the
benchmark's own methods are.

Methods: kronfluence EK-FAC and K-FAC (defaults, measurement −f as in kronfluence's examples);
dattri's explicit-Hessian influence function (regularisation 1e-2; target f, loss cross-entropy),
TRAK (projection 512; 1 and 10 checkpoints; target f), Grad-Dot (one checkpoint).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

METHODS = (
    "kronfluence_ekfac",
    "kronfluence_kfac",
    "dattri_if_explicit",
    "dattri_trak_1",
    "dattri_trak_10",
    "dattri_grad_dot",
)


def _margin(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(logits.shape[0])
    others = logits.clone()
    others[rows, labels] = float("-inf")
    return logits[rows, labels] - others.logsumexp(-1)


def kronfluence_scores(model, x, y, xt, yt, strategy):
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    class Classification(Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, labels = batch
            logits = model(inputs)
            if sample:
                with torch.no_grad():
                    labels = torch.multinomial(logits.detach().softmax(-1), 1).flatten()
            return F.cross_entropy(logits, labels, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, labels = batch
            return -_margin(model(inputs), labels).sum()

    task = Classification()
    model = prepare_model(copy.deepcopy(model), task)  # prepare_model wraps modules in place
    with tempfile.TemporaryDirectory() as tmp:
        analyzer = Analyzer(
            analysis_name="bench", model=model, task=task, output_dir=tmp, disable_tqdm=True
        )
        analyzer.fit_all_factors(
            factors_name=strategy,
            dataset=TensorDataset(x, y),
            factor_args=FactorArguments(strategy=strategy),
            per_device_batch_size=256,
            overwrite_output_dir=True,
        )
        analyzer.compute_pairwise_scores(
            scores_name="scores",
            factors_name=strategy,
            query_dataset=TensorDataset(xt, yt),
            train_dataset=TensorDataset(x, y),
            per_device_query_batch_size=256,
            per_device_train_batch_size=256,
            score_args=ScoreArguments(),
            overwrite_output_dir=True,
        )
        scores = analyzer.load_pairwise_scores("scores")["all_modules"]
    # kronfluence's score is ∇(−f)ᵀ H⁻¹ ∇ℓ_i = the effect on f of up-weighting example i
    return scores.double()


def dattri_scores(model, checkpoints, x, y, xt, yt, method):
    from dattri.algorithm.influence_function import IFAttributorExplicit
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.algorithm.trak import TRAKAttributor
    from dattri.task import AttributionTask

    def loss(params, data):
        inputs, label = data
        out = torch.func.functional_call(model, params, inputs.reshape(-1, x.shape[1]))
        return F.cross_entropy(out, label.reshape(-1))

    def margin(params, data):
        inputs, label = data
        out = torch.func.functional_call(model, params, inputs.reshape(-1, x.shape[1]))
        return _margin(out, label.reshape(-1)).sum()

    train = DataLoader(TensorDataset(x, y), batch_size=len(x), shuffle=False)
    test = DataLoader(TensorDataset(xt, yt), batch_size=len(xt), shuffle=False)
    if method.startswith("dattri_trak"):
        count = int(method.rsplit("_", 1)[1])
        task = AttributionTask(loss_func=margin, model=model, checkpoints=checkpoints[:count])

        def correct_probability(params, data):
            inputs, label = data
            out = torch.func.functional_call(model, params, inputs.reshape(-1, x.shape[1]))
            return torch.exp(-F.cross_entropy(out, label.reshape(-1)))

        attributor = TRAKAttributor(
            task=task,
            correct_probability_func=correct_probability,
            projector_kwargs=dict(proj_dim=512, device="cpu"),
            device="cpu",
        )
        attributor.cache(train)
        return attributor.attribute(test).T.double()  # positive = helps, as TRAK's
    task = AttributionTask(
        loss_func=loss, model=model, checkpoints=checkpoints[:1], target_func=margin
    )
    if method == "dattri_if_explicit":
        attributor = IFAttributorExplicit(task=task, device="cpu", regularization=1e-2)
        attributor.cache(train)
    else:
        attributor = TracInAttributor(
            task=task, weight_list=torch.ones(1), normalized_grad=False, device="cpu"
        )
    # ∇fᵀ H⁻¹ ∇ℓ_i (or ∇fᵀ∇ℓ_i): including example i moves f by minus this
    return -attributor.attribute(train, test).T.double()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inp")
    parser.add_argument("out")
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = torch.load(args.inp, weights_only=False)
    model: nn.Module = data["model"].eval()
    x, y, xt, yt = (data[k] for k in ("x", "y", "xt", "yt"))
    results = {}
    for method in args.methods.split(","):
        if method not in METHODS:
            raise SystemExit(f"unknown peer method {method!r}; valid: {', '.join(METHODS)}")
        start = time.perf_counter()
        if method.startswith("kronfluence"):
            scores = kronfluence_scores(model, x, y, xt, yt, method.rsplit("_", 1)[1])
        else:
            scores = dattri_scores(model, data["checkpoints"], x, y, xt, yt, method)
        results[method] = (scores.detach(), time.perf_counter() - start)
        torch.save(results, args.out)
        print(f"{method}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
