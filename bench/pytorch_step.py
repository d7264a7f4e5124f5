#!/usr/bin/env python3
"""PyTorch's training step of GPT-2 124M: the CPU baseline for bench_step, and the GPU baseline for
bench/gpu_gpt2.sh.

Same model as bench/bench_step.cpp: vocabulary padded to 50304, forward + backward + gradient clipping +
AdamW. On the CPU (default) micro-batch 4 x sequence 256; with --device cuda the issue's shape, 16 x 1024,
bf16 autocast, flash attention (scaled_dot_product_attention), fused AdamW and torch.compile unless
--no-compile. Prints the median step time, tokens/s, and on a GPU the model FLOP utilisation against
--peak-tflops (H100 SXM's dense bf16 peak by default), with Loom's FLOP count per token
(model/gpt_config.cpp: 3 x (per layer 2h(h + 2h) + 2h^2 + 2sh + 4hf, plus 2hV)).
Needs python3-torch; exits 0 with a note when it is missing.

    python3 bench/pytorch_step.py [--steps 5] [--threads N] [--dtype float32|bfloat16]
    python3 bench/pytorch_step.py --device cuda [--steps 20] [--no-compile]
"""
import argparse
import math
import os
import statistics
import sys
import time

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError:
    print("pytorch_step: python3-torch is not installed; skipping the PyTorch baseline")
    sys.exit(0)


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # torch < 2.0 (Debian 12's 1.13): explicit causal softmax attention
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            a = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, layers=12, h=768, heads=12, vocab=50304, positions=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(positions, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


def flops_per_token(layers=12, h=768, s=1024, vocab=50304):
    f = 4 * h
    per_layer = 2 * h * (h + 2 * h) + 2 * h * h + 2 * s * h + 2 * h * f * 2
    return 3 * (layers * per_layer + 2 * h * vocab)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("LOOM_NUM_THREADS", os.cpu_count())))
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="autocast dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--no-compile", action="store_true", help="GPU: run eagerly instead of torch.compile")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="GPU: dense bf16 peak for the MFU")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("pytorch_step: no CUDA device visible to torch; skipping the GPU baseline")
        sys.exit(0)
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    b, s = (16, 1024) if gpu else (4, 256)
    model = Gpt(positions=max(1024, s)).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **({"fused": True} if gpu else {}))
    step_model = torch.compile(model) if gpu and not args.no_compile else model
    tokens = torch.randint(0, 50257, (b, s), device=args.device)
    labels = torch.randint(0, 50257, (b, s), device=args.device)
    warmup = 3 if gpu else 1   # allocators, kernels, and on a GPU the compilation
    times = []
    for step in range(args.steps + warmup):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = step_model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if gpu:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    where = (f"{torch.cuda.get_device_name()}, {'torch.compile' if not args.no_compile else 'eager'}" if gpu
             else f"threads={args.threads}")
    line = (f"pytorch {torch.__version__} {dtype} GPT-2 124M step (b={b}, s={s}, {where}): "
            f"median {median * 1000:.1f} ms over {len(times)} steps, {b * s / median:.0f} tokens/s")
    if gpu:
        mfu = flops_per_token(s=s) * b * s / median / (args.peak_tflops * 1e12)
        line += f", MFU {100 * mfu:.1f}% of {args.peak_tflops:.0f} TFLOP/s"
    print(line + f", loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
