"""neural-tangents' empirical NTK on the benchmark's weights and inputs (run by the NT venv).

    /work/peers/nt/bin/python benchmarks/peers/nt_entk.py CASE.npz --implementation structured \
        [--repeats 3] [--reference OURS.npy]

CASE.npz (written by benchmarks/entk_speed.py) holds `arch` ("mlp" or "cnn"), the PyTorch
parameters `p0, p1, ...` in `named_parameters()` order, the inputs `x` and the PyTorch outputs
`y`. The same network is built with `neural_tangents.stax` in the standard parameterisation
(y = x W + b, so the parameters are the same numbers): Linear weights are transposed, convolutions
go from NCHW / OIHW to NHWC / HWIO. `nt.empirical_ntk_fn(..., trace_axes=(), vmap_axes=0)` gives
the full kernel [N, N, O, O]; it is jitted, compiled ahead of time (compile time reported apart)
and timed over `--repeats` calls. Memory: the peak RSS increase of the first compiled call (see
measure.py). Prints one JSON object, with the relative Frobenius error against `--reference`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import neural_tangents as nt
import numpy as np
from measure import timed
from neural_tangents import stax

IMPLEMENTATIONS = {
    "jacobian": nt.NtkImplementation.JACOBIAN_CONTRACTION,
    "ntk_vp": nt.NtkImplementation.NTK_VECTOR_PRODUCTS,
    "structured": nt.NtkImplementation.STRUCTURED_DERIVATIVES,
}


def network(arch: str, torch_params: list[np.ndarray]):
    """(apply_fn, params) of the stax network equal to the benchmark's torch model."""
    std = dict(parameterization="standard", b_std=1.0)  # b_std only scales the init
    if arch == "mlp":
        layers = [
            stax.Dense(512, **std),
            stax.Relu(),
            stax.Dense(512, **std),
            stax.Relu(),
            stax.Dense(10, **std),
        ]
        weights = [w.T if w.ndim == 2 else w for w in torch_params]
    elif arch == "cnn":
        layers = [
            stax.Conv(32, (3, 3), padding="SAME", **std),
            stax.Relu(),
            stax.Conv(64, (3, 3), padding="SAME", **std),
            stax.Relu(),
            stax.GlobalAvgPool(),
            stax.Dense(10, **std),
        ]
        layout = {4: (2, 3, 1, 0), 2: (1, 0), 1: (0,)}  # OIHW -> HWIO, [O, I] -> [I, O]
        weights = [w.transpose(layout[w.ndim]) for w in torch_params]
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'mlp' or 'cnn'")
    init_fn, apply_fn, _ = stax.serial(*layers)
    return init_fn, apply_fn, weights


def to_nhwc(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 2, 3, 1) if x.ndim == 4 else x


def load_params(init_fn, x: jnp.ndarray, weights: list[np.ndarray]):
    """Fill the stax parameter tree (from init_fn, for its structure) with the given weights."""
    _, template = init_fn(jax.random.PRNGKey(0), x.shape)
    leaves, tree = jax.tree_util.tree_flatten(template)
    if len(leaves) != len(weights):
        raise ValueError(
            f"stax network has {len(leaves)} parameter arrays, the case file {len(weights)}"
        )
    filled = []
    for leaf, w in zip(leaves, weights):
        if leaf.size != w.size:
            raise ValueError(f"parameter of shape {leaf.shape} cannot take {w.shape}")
        filled.append(jnp.asarray(w.reshape(leaf.shape)))
    return jax.tree_util.tree_unflatten(tree, filled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case")
    parser.add_argument("--implementation", choices=sorted(IMPLEMENTATIONS), required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--slow",
        type=float,
        default=20.0,
        help="stop after one timed call if it took longer than this (s)",
    )
    parser.add_argument(
        "--reference",
        help="our kernel [N, N, O, O] (.npy) to compare with (its leading block if x is a subset)",
    )
    args = parser.parse_args()

    case = np.load(args.case)
    torch_params = [case[f"p{i}"] for i in range(sum(k.startswith("p") for k in case.files))]
    init_fn, apply_fn, weights = network(str(case["arch"]), torch_params)
    x = jnp.asarray(to_nhwc(case["x"]))
    params = load_params(init_fn, x, weights)
    output_err = float(np.abs(np.asarray(apply_fn(params, x)) - case["y"]).max())

    kernel_fn = nt.empirical_ntk_fn(
        apply_fn, trace_axes=(), vmap_axes=0, implementation=IMPLEMENTATIONS[args.implementation]
    )
    start = time.perf_counter()
    compiled = jax.jit(lambda x1, p: kernel_fn(x1, None, p)).lower(x, params).compile()
    compile_s = time.perf_counter() - start

    kernel, times, mem = timed(
        lambda: compiled(x, params).block_until_ready(), args.repeats, args.slow
    )
    result = dict(
        implementation=args.implementation,
        compile_s=compile_s,
        times=times,
        median_s=statistics.median(times),
        mem_bytes=mem,
        out_bytes=int(kernel.nbytes),
        output_max_abs_err=output_err,
        rel_err=None,
    )
    if args.reference:
        ref = np.load(args.reference).astype(np.float64)[: kernel.shape[0], : kernel.shape[1]]
        result["rel_err"] = float(
            np.linalg.norm(np.asarray(kernel, np.float64) - ref) / np.linalg.norm(ref)
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
