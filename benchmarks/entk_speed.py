"""Speed and memory of the empirical NTK: ntk-toolkit against its peers, on the same weights and
inputs.

    python benchmarks/entk_speed.py                # the full benchmark (tens of minutes, 2 cores)
    python benchmarks/entk_speed.py --quick --no-peers   # seconds-long smoke run, ours only

Cases (float32, CPU, PyTorch default initialisation with a fixed seed, Gaussian inputs):
  mlp    MLP 784-512-512-10 (ReLU), full kernel [N, N, O, O], N = 256
  cnn    conv 3→32, conv 32→64 (3×3, padding 1, ReLU), global average pool, linear 64→10, on
         3×32×32 inputs, full kernel, N = 128
  trace  the MLP's trace kernel at N ∈ {1k, 4k, 16k}, ours only, with the automatic tile size and
         a fixed one (--trace-batch), to show that memory follows the tile, not N²

Methods on the full cases: ours (`ntk.empirical_ntk` with method structured / auto / jacobian /
ntk_vp); (a) the torch.func tutorial's Jacobian contraction ("Neural Tangent Kernels" tutorial:
vmap(jacrev(functional_call)) on x1 and on x2, then an einsum per parameter); (b) a per-sample
autograd loop (torch.autograd.grad per sample and output, then J Jᵀ), timed on a subset and
extrapolated; (c) neural-tangents' `empirical_ntk_fn` with each of its three implementations
(JAX, jitted, compile time apart; run by peers/nt_entk.py in its own venv); (d) nngeometry's
`GramMatrix` with its hook-based per-example Jacobian backend.

Every measurement runs in a fresh subprocess. Time: the median of --repeats calls (one call when
the first takes longer than --slow seconds). Memory: the increase of the process's resident set
during the first call, sampled every millisecond and checked against getrusage's high-water mark
(peers/measure.py); it includes the kernel itself. Accuracy: relative Frobenius error against
ours (structured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
from measure import timed  # noqa: E402

OURS = ("ours:structured", "ours:auto", "ours:jacobian", "ours:ntk_vp")
PEERS = ("tutorial", "loop", "nt:structured", "nt:jacobian", "nt:ntk_vp", "nngeometry")
LABELS = {
    "ours:structured": "ours, structured",
    "ours:auto": "ours, auto",
    "ours:jacobian": "ours, jacobian",
    "ours:ntk_vp": "ours, ntk_vp",
    "tutorial": "(a) torch.func tutorial, Jacobian contraction",
    "loop": "(b) per-sample autograd loop",
    "nt:structured": "(c) NT structured derivatives",
    "nt:jacobian": "(c) NT Jacobian contraction",
    "nt:ntk_vp": "(c) NT NTK-vector products",
    "nngeometry": "(d) nngeometry GramMatrix",
}
SEED = 0


# --------------------------------------------------------------------------------------------
# The networks and inputs (rebuilt identically in every worker from the seed)
# --------------------------------------------------------------------------------------------


def build(arch: str) -> nn.Module:
    torch.manual_seed(SEED)
    if arch == "mlp":
        model = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        )
    return model.eval()


def inputs(arch: str, n: int, first: int | None = None) -> torch.Tensor:
    """The case's n inputs (or their first `first`, for a subset run)."""
    shape = (784,) if arch == "mlp" else (3, 32, 32)
    return torch.randn((n, *shape), generator=torch.Generator().manual_seed(SEED + 1))[:first]


# --------------------------------------------------------------------------------------------
# Kernel computations, each returning the full kernel as [N, N, O, O]
# --------------------------------------------------------------------------------------------


def tutorial_ntk(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """(a) Jacobian contraction exactly as the torch.func "Neural Tangent Kernels" tutorial."""
    from torch.func import functional_call, jacrev, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def fnet_single(params, x):
        return functional_call(model, params, (x.unsqueeze(0),)).squeeze(0)

    jac1 = vmap(jacrev(fnet_single), (None, 0))(params, x1)
    jac1 = [j.flatten(2) for j in jac1.values()]
    jac2 = vmap(jacrev(fnet_single), (None, 0))(params, x2)
    jac2 = [j.flatten(2) for j in jac2.values()]
    result = torch.stack([torch.einsum("Naf,Mbf->NMab", j1, j2) for j1, j2 in zip(jac1, jac2)])
    return result.sum(0)


def loop_ntk(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(b) One torch.autograd.grad per sample and output, then the Gram matrix J Jᵀ."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        out = model(x[i : i + 1])[0]
        for o in range(out.shape[0]):
            grads = torch.autograd.grad(out[o], params, retain_graph=o + 1 < out.shape[0])
            rows.append(torch.cat([g.reshape(-1) for g in grads]))
    jac = torch.stack(rows)  # [N·O, P]
    n, o = x.shape[0], jac.shape[0] // x.shape[0]
    return (jac @ jac.T).reshape(n, o, n, o).permute(0, 2, 1, 3)


def nngeometry_ntk(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(d) nngeometry's GramMatrix: [O, N, O, N] from its per-example Jacobian hooks."""
    from nngeometry import GramMatrix
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(x), batch_size=x.shape[0])
    gram = GramMatrix(model, loader, function=lambda *d: model(d[0]))
    return gram.to_torch().permute(1, 3, 0, 2)


# --------------------------------------------------------------------------------------------
# Worker: one measurement in a fresh process
# --------------------------------------------------------------------------------------------


def worker(spec: dict) -> dict:
    import ntk
    import ntk.empirical

    arch, n, method = spec["arch"], spec["n"], spec["method"]
    model, x = build(arch), inputs(arch, n, spec.get("subset"))
    info: dict = {}
    if method.startswith("ours:"):
        chosen = []
        block_size = ntk.empirical.block_size

        def recording_block_size(*args):  # read-only instrumentation of the tile size
            chosen.append(block_size(*args))
            return chosen[-1]

        ntk.empirical.block_size = recording_block_size
        kind = spec.get("kind", "full")

        def fn():
            return ntk.empirical_ntk(
                model,
                x,
                kind=kind,
                method=method[5:],
                batch_size=spec.get("batch_size"),
            )

        kernel, times, mem = timed(fn, spec["repeats"], spec["slow"])
        info["tile"] = spec.get("batch_size") or (chosen[0] if chosen else None)
    elif method == "tutorial":
        kernel, times, mem = timed(lambda: tutorial_ntk(model, x, x), spec["repeats"], spec["slow"])
    elif method == "nngeometry":
        kernel, times, mem = timed(lambda: nngeometry_ntk(model, x), spec["repeats"], spec["slow"])
    elif method == "loop":
        kernel, times, mem = timed(lambda: loop_ntk(model, x), spec["repeats"], spec["slow"])
    else:
        raise ValueError(f"unknown method {method!r}")
    kernel = kernel.detach()
    info.update(
        times=times,
        median_s=statistics.median(times),
        mem_bytes=mem,
        out_bytes=kernel.numel() * kernel.element_size(),
        rel_err=None,
    )
    if spec.get("save"):
        np.save(spec["save"], kernel.numpy())
    if spec.get("reference"):
        ref = torch.from_numpy(np.load(spec["reference"])).double()
        ref = ref[: kernel.shape[0], : kernel.shape[1]]
        info["rel_err"] = float(torch.linalg.norm(kernel.double() - ref) / torch.linalg.norm(ref))
    return info


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    label: str
    result: dict


def run_worker(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    return _run(cmd, timeout, env=None)


def run_nt(spec: dict, args, case_file: Path) -> dict:
    cmd = [
        args.nt_python,
        str(HERE / "peers" / "nt_entk.py"),
        str(case_file),
        "--implementation",
        spec["method"][3:],
        "--repeats",
        str(spec["repeats"]),
        "--slow",
        str(spec["slow"]),
        "--reference",
        spec["reference"],
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    return _run(cmd, args.timeout, env=env)


def _run(cmd: list, timeout: float, env) -> dict:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over the {timeout:.0f} s limit"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:120]}"}
    return json.loads(lines[-1])


def write_case_npz(path: Path, arch: str, n: int, subset: int | None) -> None:
    """Weights (PyTorch layouts, named_parameters order), inputs and outputs for the NT driver."""
    model, x = build(arch), inputs(arch, n, subset)
    with torch.no_grad():
        y = model(x)
    arrays = {f"p{i}": p.detach().numpy() for i, p in enumerate(model.parameters())}
    np.savez(path, arch=arch, x=x.numpy(), y=y.numpy(), **arrays)


def jacobian_bytes(arch: str, n: int) -> int:
    """Two N × O × P float32 Jacobians: what the Jacobian-contraction peers hold at once."""
    return 2 * n * 10 * sum(p.numel() for p in build(arch).parameters()) * 4


def extrapolate(small: dict, large: dict, m: int, n: int) -> dict:
    """Fit v(k) = a·k + b·k² (b ≥ 0: Jacobians grow with k, the kernel and its contraction with
    k²) to the runs on the first m/2 and m samples; evaluate at n."""

    def fit(v_half, v_full):
        b = max(0.0, 2 * (v_full - 2 * v_half) / m**2)
        return (v_full - b * m * m) / m * n + b * n * n

    out = dict(large)
    out["median_s"] = fit(small["median_s"], large["median_s"])
    out["mem_bytes"] = int(fit(small["mem_bytes"], large["mem_bytes"]))
    out["out_bytes"] = large.get("out_bytes", 0) * (n / m) ** 2
    out["times"] = large["times"]
    out["note"] = (
        f"extrapolated from N={m // 2} and N={m} (a·N + b·N²): measured {large['median_s']:.2f} s, "
        f"{_gib(large['mem_bytes'])} GiB at N={m}"
    )
    return out


def measure(spec: dict, args, tmp: Path) -> dict:
    if not spec["method"].startswith("nt:"):
        return run_worker(spec, args.timeout)
    case_file = tmp / f"{spec['arch']}_{spec.get('subset') or spec['n']}.npz"
    if not case_file.exists():
        write_case_npz(case_file, spec["arch"], spec["n"], spec.get("subset"))
    return run_nt(spec, args, case_file)


def full_case(arch: str, n: int, methods: list[str], args, tmp: Path) -> list[Row]:
    """The full kernel of `arch` on n samples by every method. Peers that materialise the
    Jacobians run on a subset and are extrapolated when those would not fit in --max-gib, and
    the per-sample loop always is when n > --subset (it takes minutes)."""
    name = f"{arch}, N={n}, full"
    reference = tmp / f"{arch}_ref.npy"
    too_big = jacobian_bytes(arch, n) > args.max_gib * 2**30
    rows = []
    for method in methods:
        if method in args.skip:
            rows.append(Row(name, LABELS[method], {"error": "skipped (--skip)"}))
            continue
        spec = dict(arch=arch, n=n, method=method, repeats=args.repeats, slow=args.slow)
        spec["save" if method == "ours:structured" else "reference"] = str(reference)
        _say(f"{name}: {LABELS[method]} ...")
        m = args.subset
        if m < n and (method == "loop" or (too_big and method in ("tutorial", "nt:jacobian"))):
            small = measure({**spec, "subset": m // 2}, args, tmp)
            large = measure({**spec, "subset": m}, args, tmp)
            bad = small if "error" in small else large
            result = bad if "error" in bad else extrapolate(small, large, m, n)
        else:
            result = measure(spec, args, tmp)
        rows.append(Row(name, LABELS[method], result))
    return rows


def trace_case(sizes: list[int], args) -> list[Row]:
    rows = []
    for n in sizes:
        for batch in (None, args.trace_batch):
            spec = dict(
                arch="mlp",
                n=n,
                method="ours:auto",
                kind="trace",
                batch_size=batch,
                repeats=args.repeats,
                slow=args.slow,
            )
            _say(f"trace N={n}, tile {batch or 'auto'} ...")
            rows.append(
                Row(
                    f"mlp, N={n}, trace",
                    f"ours, auto, tile {batch or 'auto'}",
                    run_worker(spec, args.timeout),
                )
            )
    return rows


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _gib(nbytes) -> str:
    return "—" if nbytes is None else f"{nbytes / 2**30:.2f}"


def table(rows: list[Row]) -> str:
    """Markdown table: median time, ratio to ours (auto) in the same case, memory, error."""
    head = (
        "| case | method | median s | runs | ×ours-auto time | Δpeak GiB | Δpeak−K GiB | tile "
        "| compile s | rel. err | note |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    auto = {r.case: r.result.get("median_s") for r in rows if r.label == "ours, auto"}
    for r in rows:
        res = r.result
        if "error" in res:
            lines.append(
                f"| {r.case} | {r.label} | — | — | — | — | — | — | — | — | {res['error']} |"
            )
            continue
        base = auto.get(r.case)
        ratio = f"{res['median_s'] / base:.2f}" if base else "—"
        out = res.get("out_bytes", 0)
        note = [res["note"]] if res.get("note") else []
        if res.get("output_max_abs_err") is not None:
            note.append(f"outputs match torch to {res['output_max_abs_err']:.1e}")
        err = "—" if res.get("rel_err") is None else f"{res['rel_err']:.1e}"
        compile_s = "—" if res.get("compile_s") is None else f"{res['compile_s']:.2f}"
        lines.append(
            f"| {r.case} | {r.label} | {res['median_s']:.3f} | {len(res['times'])} | {ratio} "
            f"| {_gib(res['mem_bytes'])} | {_gib(res['mem_bytes'] - out) if out else '—'} "
            f"| {res.get('tile') or '—'} | {compile_s} | {err} | {'; '.join(note)} |"
        )
    return "\n".join(lines)


def targets(rows: list[Row]) -> str:
    """The issue's targets on the full cases: ours (auto) against the fastest peer library."""
    lines = []
    for case in dict.fromkeys(r.case for r in rows if r.case.endswith("full")):
        here = {r.label: r.result for r in rows if r.case == case and "error" not in r.result}
        ours = here.get("ours, auto")
        peers = {k: v for k, v in here.items() if k.startswith("(c)") or k.startswith("(d)")}
        if not ours or not peers:
            continue
        label, best = min(peers.items(), key=lambda kv: kv[1]["median_s"])
        speed = best["median_s"] / ours["median_s"]
        mem = ours["mem_bytes"] / max(best["mem_bytes"], 1)
        lines.append(
            f"- {case}: ours (auto) {ours['median_s']:.3f} s vs fastest peer library {label} "
            f"{best['median_s']:.3f} s → {speed:.2f}× ({'met' if speed >= 1 else 'MISSED'}, "
            f"target ≥ 1.0×); memory {_gib(ours['mem_bytes'])} vs {_gib(best['mem_bytes'])} GiB "
            f"({mem:.2f}× theirs)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a seconds-long smoke run")
    parser.add_argument("--no-peers", action="store_true", help="ours only")
    parser.add_argument("--cases", default="mlp,cnn,trace", help="comma list of mlp, cnn, trace")
    parser.add_argument(
        "--skip",
        default="",
        help="comma list of methods to skip, e.g. nt:jacobian,loop "
        f"(methods: {', '.join(OURS + PEERS)})",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--slow",
        type=float,
        default=20.0,
        help="a method whose first call takes longer than this is timed once",
    )
    parser.add_argument(
        "--subset",
        type=int,
        default=64,
        help="extrapolated peers run on the first subset/2 and subset samples",
    )
    parser.add_argument(
        "--max-gib",
        type=float,
        default=6.0,
        help="Jacobian-contraction peers needing more than this run on subsets",
    )
    parser.add_argument(
        "--trace-sizes", help="comma list of N for the trace case (default 1024,4096,16384)"
    )
    parser.add_argument(
        "--trace-batch", type=int, help="the fixed tile of the trace case (default 1024)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per measurement")
    parser.add_argument(
        "--nt-python",
        default="/work/peers/nt/bin/python",
        help="python of the neural-tangents venv (see benchmarks/README.md)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return

    args.skip = {s for s in args.skip.split(",") if s}
    unknown = args.skip - set(OURS + PEERS)
    if unknown:
        parser.error(f"unknown method(s) in --skip: {sorted(unknown)}")
    cases = {c for c in args.cases.split(",") if c}
    if cases - {"mlp", "cnn", "trace"}:
        parser.error(
            f"unknown case(s) {sorted(cases - {'mlp', 'cnn', 'trace'})}; use mlp, cnn, trace"
        )
    sizes = {"mlp": 256, "cnn": 128}
    if args.quick:
        sizes = {"mlp": 16, "cnn": 8}
        args.repeats, args.subset = min(args.repeats, 2), 8
    trace_sizes = [
        int(s)
        for s in (args.trace_sizes or ("64,128" if args.quick else "1024,4096,16384")).split(",")
    ]
    args.trace_batch = args.trace_batch or (32 if args.quick else 1024)
    methods = list(OURS) + ([] if args.no_peers else list(PEERS))

    started = time.strftime("%Y-%m-%d %H:%M")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("mlp", "cnn"):
            if arch in cases:
                rows += full_case(arch, sizes[arch], methods, args, Path(tmp))
    if "trace" in cases:
        rows += trace_case(trace_sizes, args)
    load = "/".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"eNTK speed and memory — {started}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"float32; medians of up to {args.repeats} runs; load average at the end {load}"
    )
    print(table(rows))
    summary = targets(rows)
    if summary:
        print("\nTargets (issue 2):\n" + summary)


if __name__ == "__main__":
    main()
