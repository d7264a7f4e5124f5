#!/usr/bin/env python3
"""Replays Megatron-LM's own training configurations against a Loom binary and counts which train.

Reads every training case of a Megatron-LM checkout's functional tests
(tests/functional_tests/test_cases/{gpt,moe}/*/model_config.yaml with MODEL_ARGS) and the training example
scripts (examples/{gpt3,llama,mixtral,gptoss}/*.sh), shrinks each one mechanically to a tiny model on one
rank (every parallel size 1, hidden 64, 4 heads, 64 tokens, 4 experts, --mock-data, 4 iterations; a dataset of
the repository's BPE fixture text where the configuration reads text, --fim-data), runs
`loom train` on it, and prints a line per configuration and a table of the flags that stop them.

Where a run is refused, the flag named in the message is taken out and the run tried again (up to 12 times),
so the table counts every blocker of a configuration, not only the first.

    tools/megatron_configs.py --megatron /path/to/Megatron-LM --loom build/apps/loom [--only SUBSTRING] [--layout]

With --layout each configuration runs at its own parallel layout instead (its tensor, pipeline with virtual
stages and uneven stages, context, expert and expert-tensor sizes, sequence parallelism, distributed-optimizer
instances) on the smallest world that holds it (data parallelism 1, or the instances' count), under mpirun:
hidden 128 with 8 heads so that the sizes divide, the global batch a multiple of the data-parallel size and
the pipeline.

--megatron may be a work tree or a bare git directory (read at HEAD).
"""

import argparse
import collections
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import yaml


class Source:
    def __init__(self, path):
        self.path = path
        self.bare = not os.path.isdir(os.path.join(path, "tests"))

    def files(self, prefix):
        if self.bare:
            out = subprocess.run(["git", "--git-dir", self.path, "ls-tree", "-r", "--name-only", "HEAD", prefix],
                                 check=True, capture_output=True, text=True).stdout
            return out.split()
        found = []
        for root, _, names in os.walk(os.path.join(self.path, prefix)):
            found += [os.path.relpath(os.path.join(root, n), self.path) for n in names]
        return sorted(found)

    def read(self, name):
        if self.bare:
            return subprocess.run(["git", "--git-dir", self.path, "show", "HEAD:" + name], check=True,
                                  capture_output=True, text=True).stdout
        with open(os.path.join(self.path, name)) as f:
            return f.read()


def yaml_cases(src):
    cases = []
    for name in src.files("tests/functional_tests/test_cases"):
        parts = name.split("/")
        if not name.endswith("model_config.yaml") or parts[3] not in ("gpt", "moe"):
            continue
        doc = yaml.safe_load(src.read(name))
        args = doc.get("MODEL_ARGS") or {}
        if "--train-iters" not in args and "--train-samples" not in args:
            continue   # an inference case
        flags = []
        for flag, value in args.items():
            if value is False or value is None:
                continue
            flags.append((flag, None if value is True else str(value)))
        resume = str(doc.get("TEST_TYPE", "")).startswith("ckpt-resume")
        cases.append((parts[3] + "/" + parts[4], flags, resume))
    return cases


def script_cases(src):
    """The --flag value words of an example script's argument arrays (lines inside `NAME=( ... )`)."""
    cases = []
    for name in src.files("examples"):
        if not re.match(r"examples/(gpt3|llama|mixtral|gptoss)/[^/]*train[^/]*\.sh$", name):
            continue
        words, inside, skip, env = [], False, False, {}
        for line in src.read(name).splitlines():
            line = line.split("#", 1)[0].strip()
            assign = re.match(r'^(?:export )?([A-Z_0-9]+)=("?)([^"()$ ]*|\$\{\1:-([^}]*)\})\2$', line)
            if assign:
                env[assign.group(1)] = assign.group(4) if assign.group(4) is not None else assign.group(3)
            # NAME=${OTHER} (another variable's value) and NAME=$((A*B)) (integer arithmetic of variables).
            alias = re.match(r'^(?:export )?([A-Z_0-9]+)=\$\{?([A-Z_0-9]+)\}?$', line)
            if alias and alias.group(2) in env:
                env[alias.group(1)] = env[alias.group(2)]
            arith = re.match(r'^(?:export )?([A-Z_0-9]+)=\$\(\((.*)\)\)$', line)
            if arith:
                expr = re.sub(r"\$\{?([A-Z_0-9]+)\}?", lambda m: env.get(m.group(1), "x"), arith.group(2))
                if re.fullmatch(r"[0-9+*\- ]+", expr):
                    env[arith.group(1)] = str(eval(expr))
            if re.match(r"^[A-Z_]+=\(", line):
                inside, skip = True, line.startswith("DISTRIBUTED_ARGS")
                line = line.split("(", 1)[1]
            if not inside:
                continue
            line = re.sub(r"\$\{?([A-Z_0-9]+)\}?", lambda m: env.get(m.group(1), m.group(0)), line)
            if skip:
                inside = not line.endswith(")")
                continue
            if line.endswith(")"):
                inside = False
                line = line[:-1]
            try:
                words += shlex.split(line.rstrip("\\"))
            except ValueError:
                pass
        flags = []
        for w in words:
            if w.startswith("--") and not re.match(r"^--?\d", w):
                flags.append([w, None])
            elif flags and flags[-1][1] is None:
                flags[-1][1] = w
        cases.append(("example/" + os.path.basename(name)[:-3], [tuple(f) for f in flags], False))
    return cases


PARALLEL = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
            "--expert-model-parallel-size", "--expert-tensor-parallel-size",
            "--num-distributed-optimizer-instances"]   # instances divide the data-parallel ranks, 1 here
DROP = {"--data-path", "--split", "--data-cache-path", "--num-virtual-stages-per-pipeline-rank",
        "--virtual-pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
        "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
        "--pipeline-model-parallel-layout", "--exit-interval", "--hierarchical-context-parallel-sizes",
        "--tokenizer-model", "--tokenizer-type", "--vocab-file", "--merge-file", "--vocab-size",
        "--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--lr-decay-iters", "--lr-warmup-iters",
        "--lr-wsd-decay-iters", "--lr-wsd-decay-samples", "--load", "--save",
        "--pretrained-checkpoint", "--tensorboard-dir", "--wandb-save-dir", "--eval-interval", "--eval-iters",
        "--save-interval", "--log-interval", "--exit-duration-in-mins", "--micro-batch-size",
        "--global-batch-size", "--seq-length", "--max-position-embeddings", "--train-iters", "--mock-data",
        "--sequence-parallel", "--data-args-path", "--per-split-data-args-path", "--timing-log-option",
        "--tensorboard-log-interval", "--profile-ranks", "--distributed-timeout-minutes",
        # Flags whose own Megatron asserts need the layout taken away above (Megatron refuses them at size 1):
        # TP comm overlap needs sequence parallelism, the optimizer-step overlap virtual stages, a2a+p2p
        # the hierarchical context-parallel sizes.
        "--tp-comm-overlap", "--tp-comm-overlap-cfg", "--overlap-param-gather-with-optimizer-step", "--cp-comm-type"}
# Open MPI on one machine in a container (as the tests' LOOM_MPI_ENV).
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "OMPI_MCA_btl": "self,vader"}
# Placeholders Megatron's test harness fills in, with the value of its first repeat.
HARNESS = {"{REPEAT}": "1"}


# What --layout keeps of DROP and PARALLEL: the layout itself.
LAYOUT = {"--sequence-parallel", "--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size",
          "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
          "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout", "--hierarchical-context-parallel-sizes",
          "--tp-comm-overlap", "--overlap-param-gather-with-optimizer-step", "--cp-comm-type"}


def size_of(given, flag, default=1):
    try:
        return int(given.get(flag, default))
    except (TypeError, ValueError):
        return default


def layout_of(given):
    """(world, data-parallel size, pipeline size) of a configuration's own layout on its smallest world."""
    tp, pp, cp = (size_of(given, f) for f in PARALLEL[:3])
    ep = size_of(given, "--expert-model-parallel-size")
    etp = size_of(given, "--expert-tensor-parallel-size", tp)
    instances = size_of(given, "--num-distributed-optimizer-instances")
    dense, expert = tp * pp * cp, etp * ep * pp
    world = dense * expert // math.gcd(dense, expert)
    while (world // dense) % instances or (world // expert) % instances:   # both data-parallel sizes divide
        world += dense * expert // math.gcd(dense, expert)
    return world, world // dense, pp


BPE_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "bpe")


def text_dataset(loom, work):
    """A Megatron dataset of the BPE fixture's lines (four times over), for configurations that read text
    (--fim-data): its prefix."""
    with open(os.path.join(BPE_FIXTURE, "sample.txt")) as f:
        lines = [l.strip() for l in f if l.strip()]
    with open(work + "/text.jsonl", "w") as f:
        for line in lines * 4:
            f.write(json.dumps({"text": line}) + "\n")
    subprocess.run([loom, "data", "--input", work + "/text.jsonl", "--output-prefix", work + "/text",
                    "--vocab-file", BPE_FIXTURE + "/vocab.json", "--merge-file", BPE_FIXTURE + "/merges.txt"],
                   check=True, capture_output=True)
    return work + "/text_text_document"


def shrink(flags, work, layout=False, text=None):
    """The tiny command line for a configuration's flags: one rank, or (layout) its own layout; `text`: the
    prefix of a text dataset to read instead of --mock-data."""
    given = dict(flags)
    world, dp, pp = layout_of(given) if layout else (1, 1, 1)
    # A global batch every layout splits into whole micro-batches, a multiple of pp (and of the interleaved
    # schedule's micro-batch group, which must leave no partial group).
    group = size_of(given, "--microbatch-group-size-per-virtual-pipeline-stage") if layout else 1
    unit = dp * max(1, pp) * group // math.gcd(max(1, pp), group)
    out = []
    for flag, value in flags:
        if layout and (flag in LAYOUT or flag in PARALLEL):
            out.append((flag, value))
            continue
        if flag in DROP or flag in PARALLEL:
            continue
        value = None if value is None else value.replace("${", "{")
        value = HARNESS.get(value, value)
        if flag == "--hidden-size":
            value = "128" if layout else "64"
        elif flag in ("--ffn-hidden-size", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"):
            value = "64" if flag != "--ffn-hidden-size" else "128"
        elif flag == "--num-attention-heads":
            value = "8" if layout else "4"
        elif flag == "--num-query-groups":
            if layout:
                value = str(max(2, size_of(given, "--tensor-model-parallel-size")))
            else:
                value = "2" if value not in ("1", "4") else value
        elif flag == "--kv-channels":
            value = "16"
        elif flag == "--num-experts":
            value = str(max(4, size_of(given, "--expert-model-parallel-size"))) if layout else "4"
        elif flag == "--moe-router-topk":
            value = str(min(int(value), 2))
        elif flag in ("--moe-router-num-groups", "--moe-router-group-topk"):
            value = "2" if flag == "--moe-router-num-groups" else "1"
        elif flag == "--num-layers":
            keep = layout and any(f in given for f in LAYOUT if "pipeline" in f or "virtual" in f)
            value = value if keep or "--moe-layer-freq" in given or not value.isdigit() or int(value) <= 8 else "8"
            # whole layers per stage (a custom layout says where each layer goes, and counts them; with
            # --account-for-* the embedding and the loss count as layers, and the configuration's count divides)
            accounted = "--account-for-embedding-in-pipeline-split" in given or "--account-for-loss-in-pipeline-split" in given
            if (layout and value.isdigit() and int(value) % pp and "--pipeline-model-parallel-layout" not in given
                    and not accounted):
                value = str((int(value) + pp - 1) // pp * pp)
        elif flag == "--step-batch-size-schedule":   # tokens: a batch for the first samples, then twice it
            value = "0:%d %d:%d" % (unit, 64 * unit, 2 * unit) if layout else "0:1 128:2"
        elif flag == "--rampup-batch-size":          # from one unit to the global batch over two samples
            value = "%d %d 2" % (unit, unit) if layout else "1 1 2"
        elif flag == "--eval-global-batch-size":
            value = str(2 * unit) if layout else "2"
        out.append((flag, value))
    if text:
        out += [("--data-path", text), ("--split", "90,5,5"), ("--vocab-file", BPE_FIXTURE + "/vocab.json"),
                ("--merge-file", BPE_FIXTURE + "/merges.txt")]
    else:
        out += [("--mock-data", None), ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", "512")]
    out += [("--seq-length", "64"), ("--max-position-embeddings", "64"), ("--micro-batch-size", "1"),
            ("--train-iters", "4"), ("--eval-interval", "2"), ("--eval-iters", "1"),
            ("--log-interval", "1"), ("--save", work + "/ckpt"), ("--save-interval", "2"),
            ("--tensorboard-dir", work + "/tb")]
    if "--step-batch-size-schedule" not in given:   # Megatron refuses a global batch beside the schedule
        out.append(("--global-batch-size", str(2 * unit)))
    if "--num-layers" not in given:
        out.append(("--num-layers", "2"))
    return out


def argv(loom, flags, world=1):
    words = ([os.environ.get("MPIEXEC", "mpirun"), "--oversubscribe", "-np", str(world)] if world > 1 else []) + [loom, "train"]
    for flag, value in flags:
        words.append(flag)
        if value is not None:   # nargs flags (--rampup-batch-size 16 8 300) take each word
            if re.match(r"^\[[^]]+\]$", value):   # a YAML list, "[a b c]": the harness passes its words
                words += value[1:-1].split()
            else:
                words += value.split() if flag in ("--rampup-batch-size", "--cp-comm-type",
                                                   "--hierarchical-context-parallel-sizes") else [value]
    return words


def blocker(output, flags):
    """The flag a refused run names, or the message's first line (warnings are not refusals)."""
    names = {f for f, _ in flags}
    for line in output.splitlines():
        if line.startswith("WARNING"):
            continue
        for m in re.finditer(r"(--[a-z0-9][a-z0-9-_]*)", line):
            if m.group(1) in names:
                return m.group(1), line.strip()
    lines = [l.strip() for l in output.splitlines() if l.strip()]
    return None, lines[-1] if lines else "(no output)"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--megatron", required=True)
    p.add_argument("--loom", required=True)
    p.add_argument("--only", default="")
    p.add_argument("--timeout", type=int, default=120)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--layout", action="store_true", help="run each at its own parallel layout (under mpirun)")
    p.add_argument("--max-world", type=int, default=16, help="--layout: skip layouts of more ranks than this")
    a = p.parse_args()
    src = Source(a.megatron)
    cases = [c for c in yaml_cases(src) + script_cases(src) if a.only in c[0]]
    blockers, trained, skipped = collections.Counter(), 0, 0
    for name, flags, _ in cases:
        if a.layout and layout_of(dict(flags))[0] > a.max_world:
            skipped += 1
            print("skip %s  <- a world of %d ranks (--max-world %d)" % (name, layout_of(dict(flags))[0], a.max_world))
            continue
        work = tempfile.mkdtemp(prefix="loom_megatron_")
        try:
            text = text_dataset(a.loom, work) if "--fim-data" in dict(flags) else None
            current = shrink(flags, work, a.layout, text)
            world = layout_of(dict(flags))[0] if a.layout else 1
            found = []
            for attempt in range(12):
                shutil.rmtree(work + "/ckpt", ignore_errors=True)
                try:
                    r = subprocess.run(argv(a.loom, current, world), capture_output=True, text=True, timeout=a.timeout,
                                       env=dict(os.environ, LOOM_NUM_THREADS="1", **MPI_ENV))
                    rc, out = r.returncode, r.stdout + r.stderr
                except subprocess.TimeoutExpired:
                    rc, out = -1, "timed out after %d s" % a.timeout
                if rc == 0:
                    break
                flag, line = blocker(out, current)
                found.append(flag or line)
                if flag is None:
                    break
                current = [f for f in current if f[0] != flag]
            if not found:
                trained += 1
            blockers.update(set(found))
            print("%-4s %s%s" % ("ok" if not found else "no", name, "" if not found else "  <- " + "; ".join(found)))
            if a.verbose and found:
                print("     " + " ".join(shlex.quote(w) for w in argv(a.loom, shrink(flags, work, a.layout, text), world)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print("\n%d of %d configurations train%s" % (trained, len(cases), " (%d skipped: worlds above --max-world)" % skipped
                                                                    if skipped else ""))
    print("\nblockers, by the number of configurations each stops:")
    for what, n in blockers.most_common():
        print("%5d  %s" % (n, what))


if __name__ == "__main__":
    sys.exit(main())
