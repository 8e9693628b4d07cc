"""Parameter-sized temporaries in a method's per-step arithmetic, on this device: microseconds
per step of each method's update written as the formula (one fresh tensor per operation and
parameter) beside the in-place form the methods use (buffers made once per local update;
copied here without the forward/backward their steps include), in one run, with a check that both give the same bits. The evidence behind the buffers of
pFedMe, Per-FedAvg, APFL and `proximal_hook` (docs/throughput.md).

    .venv/bin/python benchmarks/temporaries.py            # one thread, the CPU
    .venv/bin/python benchmarks/temporaries.py --model cnn4 --repeats 5

Per row: the parameters of the model as the engine builds it (fedavg_cnn on 1x28x28:
0.58 M parameters; channels-last where the engine uses it), random gradients and anchors;
the two forms run back to back `--repeats` times, alternating; the best is printed. Only the
element-wise arithmetic is timed (no forward/backward): compare it with a training step
(benchmarks/layouts.py) to see its share.
"""

from __future__ import annotations

import argparse
import time

import torch

from fedrepro.engine.engine import use_layout
from fedrepro.models import build_model

LAM, PLR, MU, LR = 1.0, 0.01, 0.001, 0.005  # the parity protocol's pFedMe / Per-FedAvg values


def pfedme_formula(ps, ws, gs, _):
    for p, w, g in zip(ps, ws, gs):
        p.sub_(PLR * (g + LAM * (p - w) + MU * p))


def pfedme_inplace(ps, ws, gs, bufs):
    for p, w, g, (d, e) in zip(ps, ws, gs, bufs):
        torch.sub(p, w, out=d).mul_(LAM).add_(g)
        d.add_(torch.mul(p, MU, out=e))
        p.sub_(d.mul_(PLR))


def perfedavg_formula(ps, ws, gs, _):  # w's copy, the temporary step, the restore, the meta step
    w0 = [p.detach().clone() for p in ps]
    for p, g in zip(ps, gs):
        p.sub_(LR * g)
    for p, w in zip(ps, w0):
        p.copy_(w)
    for p, g in zip(ps, gs):
        p.sub_(LR * g)


def perfedavg_inplace(ps, ws, gs, bufs):
    w0, step = [b[0] for b in bufs], [b[1] for b in bufs]
    torch._foreach_copy_(w0, ps)
    for p, g, d in zip(ps, gs, step):
        p.sub_(torch.mul(g, LR, out=d))
    torch._foreach_copy_(ps, w0)
    for p, g, d in zip(ps, gs, step):
        p.sub_(torch.mul(g, LR, out=d))


def proximal_formula(ps, ws, gs, _):
    for p, w, g in zip(ps, ws, gs):
        g.add_(p - w, alpha=MU)


def proximal_inplace(ps, ws, gs, bufs):
    for p, w, g, (d, _) in zip(ps, ws, gs, bufs):
        g.add_(torch.sub(p, w, out=d), alpha=MU)


ROWS = [("pFedMe inner step", pfedme_formula, pfedme_inplace),
        ("Per-FedAvg meta step (FO)", perfedavg_formula, perfedavg_inplace),
        ("proximal term (FedProx, Ditto, FedAMP)", proximal_formula, proximal_inplace)]


def per_step_us(fn, state, steps: int) -> float:
    for _ in range(10):
        fn(*state)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn(*state)
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fedavg_cnn")
    ap.add_argument("--shape", type=int, nargs=3, default=(1, 28, 28))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = use_layout(build_model(args.model, tuple(args.shape), 10), "auto", device)  # as the engine lays it out
    base = [p.detach().clone() for p in model.parameters()]
    n = sum(p.numel() for p in base)

    def fresh():
        torch.manual_seed(1)
        ps = [p.clone() for p in base]
        ws = [p + 0.01 * torch.randn_like(p) for p in base]
        gs = [torch.randn_like(p) for p in base]
        bufs = [(torch.empty_like(p), torch.empty_like(p)) for p in base]
        return ps, ws, gs, bufs

    print(f"{args.model} {tuple(args.shape)}: {n / 1e6:.2f} M parameters, {args.threads} thread(s), best of {args.repeats}")
    print("| update | formula µs/step | in place µs/step | speed-up | same bits |")
    print("|---|---|---|---|---|")
    for name, formula, inplace in ROWS:
        a, b = fresh(), fresh()
        formula(*a), inplace(*b)
        same = all(torch.equal(x, y) for x, y in zip(a[0] + a[2], b[0] + b[2]))
        best = {"formula": float("inf"), "inplace": float("inf")}
        for _ in range(args.repeats):
            best["formula"] = min(best["formula"], per_step_us(formula, fresh(), args.steps))
            best["inplace"] = min(best["inplace"], per_step_us(inplace, fresh(), args.steps))
        print(f"| {name} | {best['formula']:,.0f} | {best['inplace']:,.0f} | "
              f"{best['formula'] / best['inplace']:.2f}x | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
