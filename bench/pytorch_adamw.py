#!/usr/bin/env python3
"""PyTorch's CPU AdamW on 100M f32 parameters, the baseline for bench_adam's host Adam.

One flat f32 parameter of --params elements (master weights, as the hybrid device optimizer's host part
holds a shard; --tensors splits it) with an f32 gradient; torch.optim.AdamW with the same hyperparameters as bench_adam
(lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1), once per available implementation: foreach
(multi-tensor) and the single-tensor loop, plus fused when this torch has it for CPU (torch >= 2.4; Debian
12's 1.13 has not). Prints the median step time over --steps timed steps (after one warm-up step that
creates the state) and parameters/s. Threads: LOOM_NUM_THREADS, else every available core, the budget
Loom uses. Needs Debian's python3-torch; exits 0 with a note when it is missing.

    /usr/bin/python3 bench/pytorch_adamw.py [--params 100000000] [--tensors 1] [--steps 5] [--threads N]
"""
import argparse
import inspect
import os
import statistics
import sys
import time

try:
    import torch
except ImportError:
    print("pytorch_adamw: python3-torch is not installed; skipping the PyTorch AdamW baseline")
    sys.exit(0)


def default_threads():
    if os.environ.get("LOOM_NUM_THREADS"):
        return int(os.environ["LOOM_NUM_THREADS"])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def time_adamw(n, tensors, steps, **impl):
    params = []
    for k in range(tensors):
        size = n // tensors + (1 if k < n % tensors else 0)
        param = torch.nn.Parameter(torch.empty(size, dtype=torch.float32).uniform_(-1, 1))
        param.grad = torch.empty(size, dtype=torch.float32).uniform_(-1e-3, 1e-3)
        params.append(param)
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **impl)
    opt.step()   # warm-up: allocates exp_avg and exp_avg_sq
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--tensors", type=int, default=1, help="split the parameters into this many tensors")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=default_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    accepted = inspect.signature(torch.optim.AdamW.__init__).parameters
    impls = [("foreach", {"foreach": True}), ("single-tensor", {"foreach": False})]
    if "fused" in accepted and tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 4):
        impls.append(("fused", {"fused": True}))

    print(f"pytorch {torch.__version__} AdamW, {args.params} f32 parameters in {args.tensors} tensor(s), "
          f"threads={torch.get_num_threads()}, median of {args.steps} steps")
    for name, impl in impls:
        seconds = time_adamw(args.params, args.tensors, args.steps, **impl)
        # torch's foreach and single-tensor AdamW make several passes over the arrays; 28 bytes per parameter
        # is the minimum traffic (p, m, v read and written, g read), as bench_adam counts it.
        print(f"  {name:14s} {seconds * 1e3:9.1f} ms/step  {args.params / seconds:.3g} parameters/s  "
              f"{28 * args.params / seconds / 1e9:.1f} GB/s effective (28 B/parameter)")


if __name__ == "__main__":
    main()
