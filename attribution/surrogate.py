"""`KernelSurrogate`: a kernel machine on the eNTK that behaves like the network, with the exact
decomposition of its prediction into one term per training example.

The machine's decision function is affine in the kernel, d(x) = Σ_i K(x, x_i) A_i + b, so the
contribution of training example i to test example x is K(x, x_i) A_i (Θ(x, x_i) A_i for the
full kernel), and the contributions plus the intercept b sum to d(x) exactly. This is the
surrogate-model view of Engel et al. (ICLR 2024, "Faithful and efficient explanations for neural
networks via neural tangent kernel surrogate models"), with scikit-learn's machines on
precomputed kernels and the regularisation chosen by cross-validation.
"""

from __future__ import annotations

import warnings

import numpy as np
import scipy.linalg
import torch
from scipy.stats import kendalltau, spearmanr
from sklearn.base import BaseEstimator
from sklearn.kernel_ridge import KernelRidge
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import jaccard_score, r2_score
from sklearn.model_selection import GridSearchCV, GroupKFold, KFold
from sklearn.svm import SVC
from sklearn.utils.validation import check_is_fitted
from torch import nn

from . import _kernels
from ._outputs import labels, logits

MACHINES = ("ridge", "svm", "logistic")
KINDS = _kernels.OUTPUT_KINDS
GRID = np.logspace(-6, 2, 5)


class KernelSurrogate(BaseEstimator):
    """A scikit-learn kernel machine on the eNTK of `model`.

    kind: "trace" (default), "sum_logits" or "full" (ridge only: the multi-output kernel as an
    [N·O, N·O] matrix). normalize: cosine-normalise the kernel, K(x, x')/√(K(x, x) K(x', x'))
    (the trNTK of Engel et al. for kind="trace"). machine: "ridge" (KernelRidge on all outputs,
    the targets' mean as intercept), "svm" (SVC; one decision column per class, the sum of its
    signed one-vs-one decision values) or "logistic" (multinomial LogisticRegression on kernel
    rows, d(x) = W K(X, x) + b). projection_dim: None for the exact kernel, else the dimension
    of a random projection (`projections.projected_ntk`, seeded by `seed`). alpha: the
    regularisation (ridge α, 1/C for svm and logistic) on the kernel scaled to unit mean
    diagonal; None chooses it from GRID by `cv`-fold cross-validation on the training set.
    output_fn maps the model's output to a [B, O] tensor (e.g. `lambda out: out.logits` for a
    HuggingFace model); dtype: the dtype kernels are computed in (None: the model's; the machines
    are fitted in float64 either way). The model is never modified. Defaults: `python
    benchmarks/attribution_digits.py --sections faithfulness` measures every kind and machine;
    `trace` + ridge is the default, as faithful to the network's outputs as the best exact scalar
    kind and the best projected one at a fraction of `full`'s time (svm and logistic fit labels,
    not outputs, and follow it less).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        kind: str = "trace",
        machine: str = "ridge",
        normalize: bool = False,
        projection_dim: int | None = None,
        alpha: float | None = None,
        cv: int = 3,
        seed: int = 0,
        batch_size: int | None = None,
        device=None,
        output_fn=None,
        dtype: torch.dtype | None = None,
    ):
        self.model = model
        self.kind = kind
        self.machine = machine
        self.normalize = normalize
        self.projection_dim = projection_dim
        self.alpha = alpha
        self.cv = cv
        self.seed = seed
        self.batch_size = batch_size
        self.device = device
        self.output_fn = output_fn
        self.dtype = dtype

    # -- kernels ---------------------------------------------------------------------------------
    def _check_params(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.machine not in MACHINES:
            raise ValueError(f"machine must be one of {', '.join(MACHINES)}, got {self.machine!r}")
        if self.kind == "full" and (self.machine != "ridge" or self.normalize):
            raise ValueError(
                "kind='full' (a multi-output kernel) works with machine='ridge' and "
                "normalize=False only"
            )
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"alpha must be positive or None, got {self.alpha!r}")

    def _opts(self) -> dict:
        return dict(
            kind=self.kind,
            dim=self.projection_dim,
            seed=self.seed,
            batch_size=self.batch_size,
            device=self.device,
            output_fn=self.output_fn,
            dtype=self.dtype,
        )

    def _as_matrix(self, k: torch.Tensor) -> np.ndarray:
        """Scale to the training kernel's unit mean diagonal; `full` [N1, N2, O, O] → [N1·O,
        N2·O]."""
        if self.kind == "full":
            n1, n2, o = k.shape[:3]
            k = k.permute(0, 2, 1, 3).reshape(n1 * o, n2 * o)
        return (k / self.scale_).numpy()

    def _test_kernel(self, x) -> np.ndarray:
        check_is_fitted(self, "dual_")
        expected = getattr(self, "n_features_in_", None)
        if expected is not None and getattr(x, "ndim", None) == 2 and x.shape[1] != expected:
            raise ValueError(  # scikit-learn's wording, which its estimator checks expect
                f"X has {x.shape[1]} features, but KernelSurrogate is expecting {expected} "
                "features as input"
            )
        k = _kernels.compute(self.model, x, self.x_train_, **self._opts())
        if self.normalize:
            k = _kernels.cosine(
                k, _kernels.self_similarity(self.model, x, **self._opts()), self.diag_
            )
        return self._as_matrix(k)

    # -- fitting ---------------------------------------------------------------------------------
    def fit(self, x_train, y=None) -> KernelSurrogate:
        """Fit the machine to the network's outputs (y=None: its logits for ridge, its predicted
        labels for svm and logistic) or to class labels y."""
        self._check_params()
        g = logits(self.model, x_train, output_fn=self.output_fn, name="x_train")
        n, o = g.shape
        if y is None:
            targets = g.numpy() if self.machine == "ridge" else g.argmax(1).numpy()
        else:
            targets = labels(y, n, o).numpy()
            if self.machine == "ridge":
                targets = np.eye(o)[targets]
        k = _kernels.compute(self.model, x_train, **self._opts())
        if self.normalize:
            self.diag_ = k.diagonal().clone()
            k = _kernels.cosine(k, self.diag_, self.diag_)
        self.scale_ = 1.0 if self.normalize else float(k.diagonal().mean())
        if not self.scale_ > 0:
            raise ValueError("the training kernel has a non-positive diagonal")
        self.x_train_, self.num_outputs_ = x_train, o
        if getattr(x_train, "ndim", None) == 2:  # scikit-learn's convention: X is [N, features]
            self.n_features_in_ = x_train.shape[1]
        self._fit_machine(self._as_matrix(k), targets, o)
        return self

    def _fit_machine(self, k: np.ndarray, targets: np.ndarray, o: int) -> None:
        n = k.shape[0] // (o if self.kind == "full" else 1)
        groups = None
        if self.machine == "ridge":
            self.intercept_ = targets.mean(0)
            targets = targets - self.intercept_
            if self.kind == "full":
                targets, groups = targets.reshape(-1), np.repeat(np.arange(n), o)
            estimator, grid = KernelRidge(kernel="precomputed"), {"alpha": GRID}
            cv = (
                GroupKFold(self.cv)
                if groups is not None
                else KFold(self.cv, shuffle=True, random_state=self.seed)
            )
        elif self.machine == "svm":
            estimator, grid = (
                SVC(kernel="precomputed", decision_function_shape="ovo"),
                {"C": 1 / GRID},
            )
            cv = self.cv
        else:
            estimator, grid = LogisticRegression(max_iter=2000), {"C": 1 / GRID}
            cv = self.cv
        ((name, _),) = grid.items()
        if self.alpha is None:
            with warnings.catch_warnings():  # regularisations too weak for a fold score badly
                warnings.simplefilter("ignore")
                search = GridSearchCV(estimator, grid, cv=cv, refit=False).fit(
                    k, targets, groups=groups
                )
            value = search.best_params_[name]
        else:
            value = self.alpha if self.machine == "ridge" else 1 / self.alpha
        self.alpha_ = value if self.machine == "ridge" else 1 / value
        fitted = estimator.set_params(**{name: value})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fitted.fit(k, targets)
        for w in caught:
            if issubclass(w.category, scipy.linalg.LinAlgWarning) or "Singular matrix" in str(
                w.message
            ):
                warnings.warn(
                    f"the training kernel is ill-conditioned for alpha={self.alpha_:.3g} "
                    f"({w.message}); the surrogate and its attributions may be unstable: "
                    "pass a larger alpha or normalize=True",
                    RuntimeWarning,
                    stacklevel=3,
                )
                break
        else:
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        self.machine_ = fitted
        if self.machine == "ridge":
            self.classes_ = np.arange(o)
            self.dual_ = fitted.dual_coef_.reshape(n, o)
        elif self.machine == "svm":
            self.classes_ = fitted.classes_
            pairs, signs = _svm_pairs(fitted)
            self.dual_ = pairs @ signs
            self.intercept_ = fitted.intercept_ @ signs
        else:
            self.classes_ = fitted.classes_
            self.dual_, self.intercept_ = fitted.coef_.T, fitted.intercept_

    # -- prediction and attribution -------------------------------------------------------------
    def decision_function(self, x) -> np.ndarray:
        """d(x) [N, C]: logits (ridge on outputs), class scores (svm) or class log-odds
        (logistic)."""
        return self._decision(self._test_kernel(x))

    def _decision(self, k: np.ndarray) -> np.ndarray:
        if self.kind == "full":
            return (k @ self.dual_.reshape(-1)).reshape(-1, self.num_outputs_) + self.intercept_
        return k @ self.dual_ + self.intercept_

    def predict(self, x) -> np.ndarray:
        k = self._test_kernel(x)
        if self.machine == "ridge":
            return self.classes_[self._decision(k).argmax(1)]
        return self.machine_.predict(k)

    def attribute(self, x_test) -> np.ndarray:
        """Contributions [N_test, N_train, C] of every training example to every column of
        `decision_function`; summed over training examples, plus `intercept_`, they equal it."""
        k = self._test_kernel(x_test)
        n = self.dual_.shape[0]
        if self.kind == "full":
            o = self.num_outputs_
            return np.einsum("moiq,iq->mio", k.reshape(-1, o, n, o), self.dual_)
        return k[:, :, None] * self.dual_[None]

    def proponents(self, x_test, k: int = 5, output=None) -> tuple[np.ndarray, np.ndarray]:
        """The k training examples that most increase each test example's decision for `output`
        (default: the predicted class): (indices [N_test, k], contributions [N_test, k])."""
        return self._ranked(x_test, k, output, 1.0)

    def opponents(self, x_test, k: int = 5, output=None) -> tuple[np.ndarray, np.ndarray]:
        """The k training examples that most decrease it (most negative contributions first)."""
        return self._ranked(x_test, k, output, -1.0)

    def _ranked(self, x_test, k, output, sign):
        c = self.attribute(x_test)
        if output is None:
            column = (c.sum(1) + self.intercept_).argmax(1)
        else:
            if not 0 <= output < c.shape[2]:
                raise ValueError(f"output must be in 0..{c.shape[2] - 1}, got {output}")
            column = np.full(c.shape[0], output)
        if not 0 < k <= c.shape[1]:
            raise ValueError(f"k must be in 1..{c.shape[1]}, got {k}")
        chosen = c[np.arange(c.shape[0]), :, column] * sign
        idx = np.argsort(-chosen, axis=1, kind="stable")[:, :k]
        return idx, np.take_along_axis(chosen, idx, 1) * sign

    def faithfulness(self, x_test, y_test=None) -> dict:
        """How closely the surrogate follows the network on x_test.

        tau_prob / spearman_prob: Kendall τ / Spearman ρ between the network's and the surrogate's
        (softmax of `decision_function`) probability of the network's predicted class;
        tau_logits / spearman_logits / r2_logits: over all outputs, both centred per sample
        (when the decision has one column per output); label_agreement; with y_test also the
        accuracies, their gap and the Jaccard overlap of the misclassified sets.
        """
        g = logits(self.model, x_test, output_fn=self.output_fn, name="x_test").numpy()
        k = self._test_kernel(x_test)
        d = self._decision(k)
        pred_net = g.argmax(1)
        pred_sur = (
            self.classes_[d.argmax(1)] if self.machine == "ridge" else self.machine_.predict(k)
        )
        result = {"label_agreement": float(np.mean(pred_net == pred_sur))}
        rows = np.arange(len(g))
        if d.shape[1] == g.shape[1]:
            p_net = torch.as_tensor(g).softmax(1).numpy()[rows, pred_net]
            p_sur = torch.as_tensor(d).softmax(1).numpy()[rows, pred_net]
            gc, dc = (g - g.mean(1, keepdims=True)).ravel(), (d - d.mean(1, keepdims=True)).ravel()
            result.update(
                tau_prob=float(kendalltau(p_net, p_sur).statistic),
                spearman_prob=float(spearmanr(p_net, p_sur).statistic),
                tau_logits=float(kendalltau(gc, dc).statistic),
                spearman_logits=float(spearmanr(gc, dc).statistic),
                r2_logits=float(r2_score(gc, dc)),
            )
        if y_test is not None:
            y = labels(y_test, len(g), g.shape[1], "y_test").numpy()
            acc_net, acc_sur = float(np.mean(pred_net == y)), float(np.mean(pred_sur == y))
            result.update(
                accuracy_net=acc_net,
                accuracy_surrogate=acc_sur,
                accuracy_gap=acc_net - acc_sur,
                misclassified_jaccard=float(
                    jaccard_score(pred_net != y, pred_sur != y, zero_division=1.0)
                ),
            )
        return result


def _svm_pairs(svc: SVC) -> tuple[np.ndarray, np.ndarray]:
    """SVC's one-vs-one decision values as Σ_i K(x, x_i) A[i, p] + b_p: the dense coefficients
    A [N, pairs] from libsvm's layout (pair (a, b): support vectors of class a carry row b−1 of
    dual_coef_, those of class b row a), and the signs [pairs, classes] that sum the signed pair
    values into one score per class (positive values vote for a; binary SVC for classes_[1])."""
    n_classes = len(svc.classes_)
    n = svc.shape_fit_[0]
    starts = np.concatenate([[0], np.cumsum(svc.n_support_)])
    pairs = [(a, b) for a in range(n_classes) for b in range(a + 1, n_classes)]
    coef = np.zeros((n, len(pairs)))
    signs = np.zeros((len(pairs), n_classes))
    for p, (a, b) in enumerate(pairs):
        if n_classes == 2:
            coef[svc.support_, p] = svc.dual_coef_[0]
            signs[p] = [-1.0, 1.0]
            continue
        sa, sb = slice(starts[a], starts[a + 1]), slice(starts[b], starts[b + 1])
        coef[svc.support_[sa], p] = svc.dual_coef_[b - 1, sa]
        coef[svc.support_[sb], p] = svc.dual_coef_[a, sb]
        signs[p, a], signs[p, b] = 1.0, -1.0
    return coef, signs
