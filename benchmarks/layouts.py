"""Convolution weight layouts on this device: samples/s of a training step and of an evaluation
pass for each conv model of the registry, default (NCHW) beside channels-last (NHWC), in one
run; the evidence behind `training.channels_last: auto` (docs/throughput.md).

    .venv/bin/python benchmarks/layouts.py                 # one thread, the CPU
    .venv/bin/python benchmarks/layouts.py --threads 2 --repeats 3

Per row: the model built as the engine builds it (seeded), random inputs of the dataset's
shape, SGD (lr 0.01, momentum 0.9) steps at the row's batch size (the first pass untimed),
then forward passes at batch 256 in eval mode. The two layouts of a row run back to back,
`--repeats` times, alternating; the best of the repeats is printed (the least disturbed by
other load). A last row times `max_pool2d` on fedavg_cnn's first feature map (10x32x24x24),
the kernel behind most of the difference.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fedrepro.engine.engine import use_layout
from fedrepro.models import build_model

ROWS = [  # model, sample shape, training batch, training steps
    ("fedavg_cnn", (1, 28, 28), 10, 200),
    ("cnn4", (1, 28, 28), 10, 100),
    ("cnn4", (3, 32, 32), 64, 15),
    ("fedavg_cnn", (3, 32, 32), 10, 200),
    ("resnet18_cifar", (3, 32, 32), 32, 4),
]


def measure(name: str, shape: tuple, batch: int, steps: int, nhwc: bool, device: torch.device) -> tuple[float, float]:
    torch.manual_seed(0)
    model = use_layout(build_model(name, shape, 10).to(device), nhwc, device)
    x = torch.randn(batch * (steps + 1), *shape, device=device)
    y = torch.randint(0, 10, (len(x),), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(i: int) -> None:
        loss = F.cross_entropy(model(x[i * batch : (i + 1) * batch]), y[i * batch : (i + 1) * batch])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    model.train()
    step(steps)  # warm-up: oneDNN primitives, allocator
    t = time.perf_counter()
    for i in range(steps):
        step(i)
    train = batch * steps / (time.perf_counter() - t)
    model.eval()
    n = min(len(x), 1024)
    with torch.no_grad():
        model(x[:256])
        t = time.perf_counter()
        for i in range(0, n, 256):
            model(x[i : i + 256])
    return train, n / (time.perf_counter() - t)


def pool_us(nhwc: bool, reps: int = 300) -> float:
    x = torch.randn(10, 32, 24, 24).relu()
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    F.max_pool2d(x, 2)
    t = time.perf_counter()
    for _ in range(reps):
        F.max_pool2d(x, 2)
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, torch {torch.__version__}, threads {args.threads}, best of {args.repeats}")
    print("| model, input, batch | NCHW train / eval samples/s | NHWC train / eval samples/s | NHWC speed-up train / eval |")
    print("|---|---|---|---|")
    for name, shape, batch, steps in ROWS:
        best = {False: (0.0, 0.0), True: (0.0, 0.0)}
        for _ in range(args.repeats):
            for nhwc in (False, True):
                train, evaluate = measure(name, shape, batch, steps, nhwc, device)
                best[nhwc] = (max(best[nhwc][0], train), max(best[nhwc][1], evaluate))
        (t0, e0), (t1, e1) = best[False], best[True]
        print(f"| {name}, {'x'.join(map(str, shape))}, {batch} | {t0:,.0f} / {e0:,.0f} | {t1:,.0f} / {e1:,.0f} | "
              f"{t1 / t0:.2f}x / {e1 / e0:.2f}x |", flush=True)
    if device.type == "cpu":
        a, b = min(pool_us(False) for _ in range(args.repeats)), min(pool_us(True) for _ in range(args.repeats))
        print(f"\nmax_pool2d(10x32x24x24, 2): NCHW {a:.0f} us, NHWC {b:.0f} us per call")


if __name__ == "__main__":
    main()
