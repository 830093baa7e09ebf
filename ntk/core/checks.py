"""Checks shared by every entry point: integers (sizes, counts, seeds) and amounts (positive
finite numbers, fractions), each refused with an error naming the option; and tensors that must
be finite, refused naming what they hold."""

from __future__ import annotations

import math
import numbers


def check_integer(value, name: str, *, least: int | None = 1, optional: bool = False):
    """`value` as an int: an integer, Python's or numpy's but not a bool, ≥ `least` (None: any);
    None passes when `optional`. Anything else is a ValueError naming `name`."""
    if value is None and optional:
        return None
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not (integral and (least is None or value >= least)):
        wanted = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}
        integer = wanted.get(least, f"an integer ≥ {least}")
        raise ValueError(f"{name} must be {integer}{' or None' if optional else ''}, got {value!r}")
    return int(value)


def check_amount(
    value, name: str, *, words: tuple[str, ...] = (), zero: bool = False, below: float | None = None
) -> None:
    """Refuse option `name` (damping, prior_precision, noise, alpha, fraction, lr) unless it is
    one of `words` or a finite number > 0 (zero=True: ≥ 0), and < `below` when given (a
    fraction: below=1). A bool, an int to Python, is refused with a TypeError instead of being
    read as 1 or 0; anything else with a ValueError."""
    if below is None:
        amount = f"a {'non-negative' if zero else 'positive'} finite number"
    else:
        amount = f"a number in {'[' if zero else '('}0, {below:g})"
    named = " or ".join(map(repr, words))
    if isinstance(value, bool):
        raise TypeError(
            f"{name} must be {named + ' or ' if words else ''}{amount}, got the bool {value!r}"
        )
    if isinstance(value, str):
        if value not in words:
            raise ValueError(
                f"{name} must be {named + ' or ' if words else ''}{amount}, got {value!r}"
            )
        return
    if not (
        isinstance(value, numbers.Real)
        and math.isfinite(value)
        and (value >= 0 if zero else value > 0)
        and (below is None or value < below)
    ):
        raise ValueError(
            f"{name} must be {amount}{f' (or {named})' if words else ''}, got {value!r}"
        )


def check_finite(values, what: str) -> None:
    """Refuse the tensor `values` if it holds NaN or ±inf: "{what} contains non-finite values
    (NaN or inf)"."""
    if not bool(values.isfinite().all()):
        raise ValueError(f"{what} contains non-finite values (NaN or inf)")
