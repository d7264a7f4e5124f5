#!/usr/bin/env python3
"""PyTorch's CPU training step of GPT-2 124M, the baseline for bench_step.

Same model and shapes as bench/bench_step.cpp: micro-batch 4, sequence 256 (1024 tokens per step),
vocabulary padded to 50304, forward + backward + gradient clipping + AdamW. Prints the median step time
and tokens/s over the timed steps. Needs Debian's python3-torch; exits 0 with a note when it is missing.

    python3 bench/pytorch_step.py [--steps 5] [--threads N] [--dtype float32|bfloat16]
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
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("LOOM_NUM_THREADS", os.cpu_count())))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    b, s = 4, 256
    model = Gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens = torch.randint(0, 50257, (b, s))
    labels = torch.randint(0, 50257, (b, s))
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step > 0:   # the first step warms up allocators and kernels
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(f"pytorch {torch.__version__} {args.dtype} GPT-2 124M step (b={b}, s={s}, threads={args.threads}): "
          f"median {median * 1000:.0f} ms over {len(times)} steps, {b * s / median:.0f} tokens/s, loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
