"""The fitted state of the toolkit's scikit-learn estimators (`KernelSurrogate`, `NTKPosterior`):
which parameter values a fit used, and the check, before any prediction, that they are still the
estimator's. `set_params` after `fit` changes the parameters, not the fitted kernels, machines or
factors, so reading a fit with other parameters would mix two settings (or fail on attributes
the other setting never made): it is refused, naming what changed, until the next `fit`."""

from __future__ import annotations

from collections.abc import Iterable

from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

# where and in what blocks the kernels are computed: free to change between fit and predict
RUN_PARAMS = ("batch_size", "device")


def record(estimator: BaseEstimator, free: Iterable[str] = ()) -> None:
    """Remember the values of the parameters this fit reads (`fit_params_`): all of
    `get_params(deep=False)` but RUN_PARAMS and the estimator's prediction-time ones, `free`."""
    skip = {*RUN_PARAMS, *free}
    estimator.fit_params_ = {
        name: value for name, value in estimator.get_params(deep=False).items() if name not in skip
    }


def check_fitted(estimator: BaseEstimator, attribute: str) -> None:
    """scikit-learn's NotFittedError where `attribute` is missing; a ValueError where a parameter
    the fit read (`record`) has been set to another value since."""
    check_is_fitted(estimator, attribute)
    changed = {
        name: value
        for name, value in estimator.fit_params_.items()
        if not _same(getattr(estimator, name), value)
    }
    if changed:
        what = ", ".join(
            f"{name}={getattr(estimator, name)!r} (fitted with {value!r})"
            for name, value in changed.items()
        )
        raise ValueError(
            f"{type(estimator).__name__}'s parameters changed since fit: {what}; call fit again "
            "to use them"
        )


def _same(a, b) -> bool:
    """The same parameter value: the same object (models, functions), or equal plain values."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # values without a truth value of ==
        return False
