"""convert + torch.compile against torch.compile alone, on the CPU: step time, peak and saved bytes.

Configurations (each a deep copy of one model, compiled with ``fullgraph=False``):
``compile`` (eager model), ``compile0.5`` (activation memory budget 0.5), ``convert+compile``
with the chains as the opaque custom op (``convbn.compile_chains("op")``) and as ops inductor
fuses (``"inductor"``, the default, Note: [a chain inductor can see into]), and with
``--strategy S`` the same for ``convert(strategy=S)``. Per configuration: thread CPU time of
one training step (forward + backward, median of interleaved rounds after warm-up), the
step's peak (gradients set to None, forward, backward with the weight gradients: live bytes
at the CPU allocator, :func:`convbn.memory.allocator_peak`, which sees compiled code's
buffers), the bytes saved for backward (distinct storages saved by the compiled graphs,
parameters excluded), and the first step's largest output / gradient difference from eager.

    python benchmarks/bm_compile_chains.py --model torchvision:resnet18 --batch-size 8 --image-size 112
"""
from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from typing import Any, Callable, Dict

import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.bench.models import build_model  # noqa: E402
from convbn.bench.training import budget_backend  # noqa: E402
from convbn.memory import allocator_peak, saved_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="torchvision:resnet18")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--strategy", action="append", default=[], choices=("recompute_bn", "recompute_conv"),
                    help="add convert(strategy=S) + compile, both chain modes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # every converted model enters Dynamo through the same frame (the rewritten forward's
    # __call__), one cache entry per model and grad mode: with 6-7 models in one process
    # the default limit of 8 would leave the last ones running uncompiled
    torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(0)
    if args.model.startswith("torchvision:"):
        import_torchvision_without_fake_kernels()  # torchvision's CPU wheel: model code only (tests/zoo.py)
    base, shape = build_model(args.model)
    shape = (shape[0],) + (args.image_size,) * (len(shape) - 1)
    x = torch.randn(args.batch_size, *shape)
    configs: Dict[str, Callable[[], Any]] = {
        "eager": lambda: copy.deepcopy(base),
        "compile": lambda: torch.compile(copy.deepcopy(base)),
        "compile0.5": lambda: torch.compile(copy.deepcopy(base), backend=budget_backend(0.5)),
        "convert+compile (op)": lambda: torch.compile(convbn.convert(copy.deepcopy(base), example_inputs=x)),
        "convert+compile (inductor)": lambda: torch.compile(convbn.convert(copy.deepcopy(base), example_inputs=x)),
    }
    for strat in args.strategy:
        for mode in ("op", "inductor"):
            configs[f"convert({strat})+compile ({mode})"] = functools.partial(
                lambda s: torch.compile(convbn.convert(copy.deepcopy(base), example_inputs=x, strategy=s)), strat)
    models, steps, info, modes = {}, {}, {}, {}
    ref = None
    for name, make in configs.items():
        mode = "op" if "(op)" in name else "inductor"
        t0 = time.time()
        m = make()
        xx = x.clone().requires_grad_()
        torch.manual_seed(1)
        with convbn.compile_chains(mode):  # read when the graph is traced: the first call
            out = m(xx)
            out.backward(torch.ones_like(out))
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        if ref is None:
            ref = (out.detach(), grads)
        dout = (out.detach() - ref[0]).abs().max().item()
        dgrad = max((a - b).abs().max().item() for a, b in zip(grads, ref[1]))
        with convbn.compile_chains(mode):
            saved = saved_bytes(m, x).activation_bytes
        info[name] = dict(saved=saved, dout=dout, dgrad=dgrad, build_s=time.time() - t0)
        m.zero_grad(set_to_none=True)
        models[name] = m
        modes[id(m)] = mode
        steps[name] = []

    def step(m: Any) -> None:
        # the model's own chain mode for every call: a recompile (another grad mode, say)
        # reads the mode then, and would otherwise trace this model with the last one set
        with convbn.compile_chains(modes[id(m)]):
            out = m(x)
            out.sum().backward()
        m.zero_grad(set_to_none=True)

    def peak(m: Any) -> int:
        m.zero_grad(set_to_none=True)
        return allocator_peak(lambda: step(m))

    for n, m in models.items():
        info[n]["peak"] = peak(m)
    for r in range(args.rounds):
        names = list(models)
        names = names[r % len(names):] + names[: r % len(names)]
        for n in names:
            t = time.thread_time()
            step(models[n])
            steps[n].append(time.thread_time() - t)
    e = statistics.median(steps["eager"])
    c = statistics.median(steps["compile"])
    se = info["eager"]["saved"]
    pe, pc = info["eager"]["peak"], info["compile"]["peak"]
    print(f"# {args.model} b{args.batch_size} {args.image_size}px, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.rounds} interleaved rounds (thread CPU time)")
    print("| config | CPU ms | x eager | x compile | peak MiB | peak x eager | peak x compile | saved MiB | saved x eager "
          "| max dout | max dgrad |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in models:
        t = statistics.median(steps[n])
        i = info[n]
        print(f"| {n} | {t * 1e3:.1f} | {t / e:.3f} | {t / c:.3f} | {i['peak'] / 2**20:.1f} | {i['peak'] / pe:.2f} | "
              f"{i['peak'] / pc:.2f} | {i['saved'] / 2**20:.1f} | {i['saved'] / se:.2f} | "
              f"{i['dout']:.1e} | {i['dgrad']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
