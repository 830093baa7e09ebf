"""eNTK of HuggingFace models called as their users call them (dicts of input_ids and
attention_mask, padded batches), ours against the torch.func recipe, in one run.

Models: a small BertForSequenceClassification and GPT2ForSequenceClassification built from
configs (nothing downloaded; random weights, eval mode). The torch.func recipe is the per-sample
Jacobian of the functional model, J(x) = jacrev(functional_call)(θ, x), and Θ = J Jᵀ: the usual
vmap over samples cannot run these models (their attention-mask code branches on values), so the
recipe loops over samples, as ours falls back to for the parameters it does not factor.
Printed: the median time of each method over `--repeats` runs, the ratio to the torch.func
recipe, and the largest difference from its kernel relative to the kernel's largest entry.

Run: python benchmarks/hf_models.py [--samples 16] [--seq 32] [--repeats 3]
     python benchmarks/hf_models.py --quick      # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch
from torch.func import functional_call, jacrev, vmap

import ntk


def models(quick: bool) -> dict:
    import transformers

    width, layers = (16, 1) if quick else (64, 2)
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=1000,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=4 * width,
            max_position_embeddings=128,
            num_labels=2,
        )
    )
    gpt2 = transformers.GPT2ForSequenceClassification(
        transformers.GPT2Config(
            vocab_size=1000,
            n_embd=width,
            n_layer=layers,
            n_head=4,
            n_positions=128,
            num_labels=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
    )
    return {"BERT": bert.eval(), "GPT-2": gpt2.eval()}


def batch(n: int, seq: int, seed: int = 0) -> dict:
    """Token ids padded at the end to random lengths between seq/2 and seq, and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 1000, (n, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (n,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def torch_func_kernel(model, x: dict, kind: str, per_sample_vmap: bool) -> torch.Tensor:
    """Θ from per-sample Jacobians by torch.func: vmapped over samples, or a loop."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def f(p, xi):
        one = {k: v[None] for k, v in xi.items()}
        return functional_call(model, (p, buffers), (), one).logits[0]

    if per_sample_vmap:
        jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    else:
        n = x["input_ids"].shape[0]
        rows = [jacrev(f)(params, {k: v[i] for k, v in x.items()}) for i in range(n)]
        jac = {k: torch.stack([r[k] for r in rows]) for k in params}
    j = torch.cat([v.flatten(2) for v in jac.values()], 2)  # [N, O, P]
    if kind == "trace":
        return torch.einsum("iop,jop->ij", j, j)
    return torch.einsum("iop,jqp->ijoq", j, j)


def median_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return out, statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny models and batch: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.seq, args.repeats = 4, 8, 1
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the fallback's one-line notice, torch's batching notes
    print(
        f"# eNTK of HuggingFace models — {platform.machine()}, {torch.get_num_threads()} thread, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; N = {args.samples}, "
        f"sequence {args.seq} (padded), median of {args.repeats}"
    )
    print(
        "\n| model | params | kind | method | median s | torch.func / this | "
        "max rel. diff vs torch.func |"
    )
    print("|---|---|---|---|---|---|---|")
    x = batch(args.samples, args.seq)
    for name, model in models(args.quick).items():
        params = sum(p.numel() for p in model.parameters())
        for kind in ("full", "trace"):
            ref, t_ref = median_time(
                lambda model=model, kind=kind: torch_func_kernel(model, x, kind, False),
                args.repeats,
            )
            scale = float(ref.abs().max())
            try:
                torch_func_kernel(model, {k: v[:2] for k, v in x.items()}, kind, True)
                vmapped = "runs"
            except RuntimeError as exc:
                vmapped = f"fails ({str(exc).split(':')[0]}: data-dependent control flow)"
            print(
                f"| {name} | {params:,} | {kind} | torch.func jacrev, loop over samples | "
                f"{t_ref:.2f} | 1.00 | 0 |"
            )
            print(f"| {name} | {params:,} | {kind} | torch.func vmap(jacrev) | {vmapped} | | |")
            for method in ("auto", "structured", "jacobian", "ntk_vp"):
                k, t = median_time(
                    lambda model=model, kind=kind, method=method: ntk.empirical_ntk(
                        model, x, kind=kind, method=method, output_fn=lambda o: o.logits
                    ),
                    args.repeats,
                )
                diff = float((k - ref).abs().max()) / scale
                print(
                    f"| {name} | {params:,} | {kind} | ours, {method} | {t:.2f} | "
                    f"{t_ref / t:.2f} | {diff:.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
