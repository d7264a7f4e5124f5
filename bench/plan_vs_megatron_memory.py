#!/usr/bin/env python3
"""`loom plan`'s memory beside Megatron's theoretical memory, for Megatron's own functional-test configurations.

    python3 bench/plan_vs_megatron_memory.py --megatron /path/to/Megatron-LM [--loom build/apps/loom]

For every dense GPT training case of Megatron's functional tests (tests/functional_tests/test_cases/gpt), at its
own sizes and layout on the 8 GPUs the tests run on, it prints the most loaded rank's (rank 0's) memory as
`loom plan` computes it (the allocator's books of the real set-up and one iteration on the meta device) and
as Megatron's megatron/training/theoretical_memory_usage.py estimates it (report_theoretical_memory, run
from the checkout with its one import of Megatron's utilities stubbed). MiB throughout:

  states        weights, gradients and optimizer state (Megatron: compute_weight_and_optimizer_memory)
  activations   loom: the activations pool's peak; Megatron: its activation formula
  total         loom: the iteration's peak; Megatron: the sum

Data and tokenizer flags are replaced by --mock-data with GPT-2's vocabulary (the tests' BPE files); a flag
`loom plan` refuses is taken out (named in the last column) and the plan tried again. docs/plan.md reads the
table and explains the differences.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import megatron_configs  # noqa: E402  (its readers of Megatron's test cases)

DROP = {"--data-path", "--split", "--data-cache-path", "--vocab-file", "--merge-file", "--tokenizer-type",
        "--tokenizer-model", "--load", "--save", "--pretrained-checkpoint", "--tensorboard-dir", "--wandb-save-dir",
        "--data-args-path", "--per-split-data-args-path", "--train-samples", "--lr-decay-samples",
        "--lr-warmup-samples", "--lr-wsd-decay-samples"}
GPT2_VOCAB = 50257
WORLD = 8


def megatron_memory_module(src):
    text = src.read("megatron/training/theoretical_memory_usage.py")
    text = text.replace("from .utils import is_hybrid_model, print_rank_0",
                        "is_hybrid_model = lambda args: False\nprint_rank_0 = lambda *a, **k: None")
    module = types.ModuleType("theoretical_memory_usage")
    exec(compile(text, "theoretical_memory_usage.py", "exec"), module.__dict__)
    return module


class Args(types.SimpleNamespace):
    """Megatron's args: the flags given, Megatron's defaults for the rest the formula reads, None otherwise."""

    def __getattr__(self, name):
        return None


def megatron_args(given):
    def number(flag, default):
        value = given.get(flag)
        return default if value is None else type(default)(float(value)) if isinstance(default, int) else float(value)

    a = Args()
    a.num_layers = number("--num-layers", 1)
    a.hidden_size = number("--hidden-size", 1)
    a.num_attention_heads = number("--num-attention-heads", 1)
    a.ffn_hidden_size = number("--ffn-hidden-size", 4 * a.hidden_size)
    if "--swiglu" in given and "--ffn-hidden-size" not in given:   # Megatron's default for SwiGLU
        a.ffn_hidden_size = int(4 * a.hidden_size * 2 / 3 / 64) * 64
    a.kv_channels = number("--kv-channels", a.hidden_size // a.num_attention_heads)
    a.group_query_attention = "--group-query-attention" in given
    a.num_query_groups = number("--num-query-groups", a.num_attention_heads)
    a.swiglu = "--swiglu" in given
    a.normalization = given.get("--normalization") or "LayerNorm"
    a.untie_embeddings_and_output_weights = "--untie-embeddings-and-output-weights" in given
    a.add_bias_linear = "--disable-bias-linear" not in given
    a.tensor_model_parallel_size = number("--tensor-model-parallel-size", 1)
    a.pipeline_model_parallel_size = number("--pipeline-model-parallel-size", 1)
    a.context_parallel_size = number("--context-parallel-size", 1)
    a.expert_model_parallel_size = number("--expert-model-parallel-size", 1)
    a.expert_tensor_parallel_size = number("--expert-tensor-parallel-size", a.tensor_model_parallel_size)
    a.world_size = WORLD
    a.data_parallel_size = WORLD // (a.tensor_model_parallel_size * a.pipeline_model_parallel_size * a.context_parallel_size)
    a.use_distributed_optimizer = "--use-distributed-optimizer" in given
    a.sequence_parallel = "--sequence-parallel" in given and a.tensor_model_parallel_size > 1
    a.recompute_granularity = given.get("--recompute-granularity")
    a.seq_length = number("--seq-length", 1)
    a.micro_batch_size = number("--micro-batch-size", 1)
    vpp = given.get("--num-virtual-stages-per-pipeline-rank") or given.get("--virtual-pipeline-model-parallel-size")
    if vpp is None and given.get("--num-layers-per-virtual-pipeline-stage"):
        vpp = a.num_layers // a.pipeline_model_parallel_size // int(given["--num-layers-per-virtual-pipeline-stage"])
    a.virtual_pipeline_model_parallel_size = None if vpp is None else int(vpp)
    multiple = 128 * a.tensor_model_parallel_size
    a.padded_vocab_size = int(math.ceil(GPT2_VOCAB / multiple) * multiple)
    a.moe_layer_freq = 1
    return a


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--megatron", required=True)
    p.add_argument("--loom", default="build/apps/loom")
    opts = p.parse_args()
    src = megatron_configs.Source(opts.megatron)
    theory = megatron_memory_module(src)
    mib = 1024 * 1024
    print(f"{'configuration':58s} {'TP':>2s} {'PP':>2s} {'DP':>2s} {'states':>15s} {'activations':>17s} "
          f"{'total':>17s}  taken out")
    print(f"{'':58s} {'':>2s} {'':>2s} {'':>2s} {'loom':>7s} {'Megatron':>8s} {'loom':>8s} {'Megatron':>8s} "
          f"{'loom':>8s} {'Megatron':>8s}")
    for name, flags, resume in megatron_configs.yaml_cases(src):
        given = dict(flags)
        if not name.startswith("gpt/") or "--num-experts" in given or resume:
            continue
        kept = [(f, v) for f, v in flags if f not in DROP and "$" not in (v or "")]
        kept += [("--mock-data", None), ("--vocab-size", str(GPT2_VOCAB))]
        taken = []
        plan = None
        for _ in range(12):
            words = [opts.loom, "plan", "--nodes", "1", "--gpus-per-node", str(WORLD), "--ranks", "0", "--json"]
            for f, v in kept:
                words.append(f)
                if v is not None:
                    words += v.split() if f in ("--rampup-batch-size", "--cp-comm-type",
                                                "--hierarchical-context-parallel-sizes") else [v]
            run = subprocess.run(words, capture_output=True, text=True)
            if run.returncode == 0:
                plan = json.loads(run.stdout)
                break
            flag, line = megatron_configs.blocker(run.stdout + run.stderr, kept)
            if flag is None:
                taken.append("(" + line[:60] + ")")
                break
            taken.append(flag)
            kept = [(f, v) for f, v in kept if f != flag]
        if plan is None or "peak_bytes" not in plan:
            print(f"{name:58s} not planned: {' '.join(taken)}")
            continue
        a = megatron_args(dict(kept))
        states = theory.compute_weight_and_optimizer_memory(a) / mib
        if a.sequence_parallel and a.recompute_granularity == "selective":
            acts = theory.compute_activation_memory(a, num_microbatches=None) / mib
        else:
            acts = theory.compute_activation_memory_without_sp(a, num_microbatches=None) / mib
        mem = plan["memory_bytes"]
        ours_states = sum(mem.get(k, 0) for k in ("weights", "grads", "optimizer")) / mib
        print(f"{name[4:]:58s} {a.tensor_model_parallel_size:2d} {a.pipeline_model_parallel_size:2d} "
              f"{a.data_parallel_size:2d} {ours_states:7.1f} {states:8.1f} {plan['activations_peak_bytes'] / mib:8.1f} "
              f"{acts:8.1f} {plan['peak_bytes'] / mib:8.1f} {states + acts:8.1f}  {' '.join(taken)}")


if __name__ == "__main__":
    main()
