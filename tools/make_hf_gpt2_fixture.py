#!/usr/bin/env python3
"""Writes tests/fixtures/hf_gpt2_tiny: a small random GPT-2 in Hugging Face's layout, and its reference
logits and loss computed by an independent float64 GPT-2 forward (the one in modeling_gpt2.py, written
out here because transformers and safetensors are not installed).

    /usr/bin/python3 tools/make_hf_gpt2_fixture.py [OUTPUT_DIR]

Files written:
  config.json        GPT2LMHeadModel config: n_layer 2, n_embd 64, n_head 4, n_positions 32, vocab_size 300
                     (not a multiple of 128, so the importer's vocabulary padding is exercised)
  model.safetensors  F32 tensors, Hub key names (no "transformer." prefix), Conv1D weights stored (in, out),
                     plus the attn.bias / attn.masked_bias buffers that old Hub files carry
  expected.json      a token stream of 33 tokens cut, as llm.c shards and loom's loader do, into 2 samples of
                     17 (stride 16): tokens (b=2, s=16), labels (b, s), the float64 mean cross-entropy over
                     the 300 real vocabulary entries, and the logits (b, s, 300) rounded to 8 significant digits

The safetensors layout: u64 little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces to a
multiple of 8, then the raw little-endian C-order bytes, offsets relative to the end of the header.
"""
import json
import math
import os
import struct
import sys

import torch

N_LAYER, N_EMBD, N_HEAD, N_POSITIONS, VOCAB = 2, 64, 4, 32, 300
BATCH, SEQ = 2, 16
EPS = 1e-5
SEED = 20240914


def make_weights(gen):
    def normal(*shape, std=0.1, mean=0.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std + mean).float()

    w = {"wte.weight": normal(VOCAB, N_EMBD), "wpe.weight": normal(N_POSITIONS, N_EMBD)}
    mask = torch.tril(torch.ones(N_POSITIONS, N_POSITIONS)).view(1, 1, N_POSITIONS, N_POSITIONS)
    for i in range(N_LAYER):
        p = f"h.{i}."
        w[p + "ln_1.weight"] = normal(N_EMBD, mean=1.0)
        w[p + "ln_1.bias"] = normal(N_EMBD)
        w[p + "attn.bias"] = mask.clone()
        w[p + "attn.masked_bias"] = torch.tensor(-1e4)
        w[p + "attn.c_attn.weight"] = normal(N_EMBD, 3 * N_EMBD)      # Conv1D: (in, out)
        w[p + "attn.c_attn.bias"] = normal(3 * N_EMBD)
        w[p + "attn.c_proj.weight"] = normal(N_EMBD, N_EMBD)
        w[p + "attn.c_proj.bias"] = normal(N_EMBD)
        w[p + "ln_2.weight"] = normal(N_EMBD, mean=1.0)
        w[p + "ln_2.bias"] = normal(N_EMBD)
        w[p + "mlp.c_fc.weight"] = normal(N_EMBD, 4 * N_EMBD)
        w[p + "mlp.c_fc.bias"] = normal(4 * N_EMBD)
        w[p + "mlp.c_proj.weight"] = normal(4 * N_EMBD, N_EMBD)
        w[p + "mlp.c_proj.bias"] = normal(N_EMBD)
    w["ln_f.weight"] = normal(N_EMBD, mean=1.0)
    w["ln_f.bias"] = normal(N_EMBD)
    return w


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        data = t.contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def layer_norm(x, weight, bias):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * weight + bias


def gpt2_forward(w, tokens):
    """GPT-2 in float64: tokens (b, s) -> logits (b, s, V)."""
    w = {k: v.double() for k, v in w.items()}
    b, s = tokens.shape
    d = N_EMBD // N_HEAD
    x = w["wte.weight"][tokens] + w["wpe.weight"][torch.arange(s)]
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    for i in range(N_LAYER):
        p = f"h.{i}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        qkv = h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]          # (b, s, 3C)
        q, k, v = qkv.split(N_EMBD, dim=-1)
        q, k, v = (t.view(b, s, N_HEAD, d).transpose(1, 2) for t in (q, k, v))   # (b, a, s, d)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~causal, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ v                                   # (b, a, s, d)
        att = att.transpose(1, 2).reshape(b, s, N_EMBD)
        x = x + att @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        h = gelu_tanh(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = layer_norm(x, w["ln_f.weight"], w["ln_f.bias"])
    return x @ w["wte.weight"].T


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "tests", "fixtures", "hf_gpt2_tiny")
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(SEED)
    weights = make_weights(gen)

    stream = torch.randint(0, VOCAB, (BATCH * SEQ + 1,), generator=gen)
    stream[5] = VOCAB - 1   # the last real vocabulary entry appears as an input and a label
    tokens = torch.stack([stream[i * SEQ:i * SEQ + SEQ] for i in range(BATCH)])
    labels = torch.stack([stream[i * SEQ + 1:i * SEQ + SEQ + 1] for i in range(BATCH)])

    logits = gpt2_forward(weights, tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).item()

    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "n_layer": N_LAYER, "n_embd": N_EMBD, "n_head": N_HEAD, "n_positions": N_POSITIONS, "n_ctx": N_POSITIONS,
        "n_inner": None, "vocab_size": VOCAB, "layer_norm_epsilon": EPS, "initializer_range": 0.02,
        "bos_token_id": VOCAB - 1, "eos_token_id": VOCAB - 1,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    write_safetensors(os.path.join(out, "model.safetensors"), weights)
    expected = {
        "batch": BATCH, "seq": SEQ, "vocab_size": VOCAB,
        "stream": stream.tolist(), "tokens": tokens.tolist(), "labels": labels.tolist(),
        "loss": loss,
        "logits": [[[float(f"{v:.8g}") for v in row] for row in seq] for seq in logits.tolist()],
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {out}: loss {loss:.10f}")


if __name__ == "__main__":
    main()
