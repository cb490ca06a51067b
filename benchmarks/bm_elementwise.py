"""One chain layer's element-wise cost per shape: the ATen path against inductor-fused kernels.

Per shape ``(N, C, H, W)`` (ResNet-50 b8's BN sites by default), in one process, interleaved
rounds, thread CPU time (``time.thread_time``; one intra-op thread unless ``--threads``), or
with ``--device cuda`` the CUDA-event time of each call after a synchronize:

* forward: ATen = ``native_batch_norm`` + the activation in place (what ``chain_forward``
  runs); fused = ``torch.compile(bn_act_forward, dynamic=True)`` (functional/bn_act.py);
* backward: ATen = rebuild ``z`` (``bn_apply``), activation backward in place,
  ``native_batch_norm_backward`` (what ``chain_backward`` runs for a kept ``y``); fused =
  ``torch.compile(bn_act_backward, dynamic=True)``.

Beside each time: the bytes the Note [one layer's element-wise passes] counts (tensor-sized
transfers x bytes per tensor) divided by the time, against the machine's copy bandwidth
measured here (``dst.copy_(src)`` of 256 MiB: read + write), and the largest difference of
the fused results from the ATen path's (float rounding).

Run::

    python benchmarks/bm_elementwise.py --rounds 7
    python benchmarks/bm_elementwise.py --shapes 8x256x56x56 --act silu --channels-last
    python benchmarks/bm_elementwise.py --device cuda --shapes 128x64x112x112 128x256x56x56
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

from convbn.functional.activations import Activation
from convbn.functional.batchnorm import BNSpec, bn_apply, bn_backward, bn_forward
from convbn.functional.bn_act import bn_act_backward, bn_act_forward, element_passes

RESNET50_B8 = ["8x64x112x112", "8x64x56x56", "8x256x56x56", "8x128x28x28", "8x512x28x28",
               "8x256x14x14", "8x1024x14x14", "8x512x7x7", "8x2048x7x7"]


def _cpu_time(fn: Callable[[], object]) -> float:
    t = time.thread_time()
    fn()
    return time.thread_time() - t


def _cuda_time(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def bandwidth(timer: Callable[[Callable[[], object]], float], device: str, mib: int = 256, rounds: int = 5) -> float:
    """Bytes per second of ``dst.copy_(src)`` (one read + one write counted), best of ``rounds``."""
    src = torch.empty(mib * 2**20 // 4, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timer(lambda: dst.copy_(src)) for _ in range(rounds))
    return 2 * src.numel() * 4 / best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=RESNET50_B8)
    p.add_argument("--act", default="relu")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    timer = _cuda_time if args.device == "cuda" else _cpu_time
    dev = args.device
    act = Activation(args.act)
    bw = bandwidth(timer, dev)
    where = torch.cuda.get_device_name() if dev == "cuda" else f"{args.threads} thread(s)"
    print(f"# torch {torch.__version__}, {where}, act={args.act}, channels_last={args.channels_last}, "
          f"copy bandwidth {bw / 1e9:.1f} GB/s (read+write)")
    fwd_c = torch.compile(bn_act_forward, dynamic=True)
    bwd_c = torch.compile(bn_act_backward, dynamic=True)
    spec = BNSpec(1e-5, True, 0.0)
    print("| shape | fwd ATen ms | fwd fused ms | fwd x | bwd ATen ms | bwd fused ms | bwd x | ATen GB/s (fwd/bwd) | fused GB/s (fwd/bwd) | max diff fwd/bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in args.shapes:
        shape = tuple(int(v) for v in s.split("x"))
        y = torch.randn(shape, device=dev)
        if args.channels_last:
            y = y.contiguous(memory_format=torch.channels_last)
        g = torch.randn_like(y)
        w, b = torch.rand(shape[1], device=dev) + 0.5, torch.randn(shape[1], device=dev)

        def fwd_aten():
            z, m, i = bn_forward(y, w, b, None, None, spec)
            return act(z, inplace=True), m, i

        out_a, mean, invstd = fwd_aten()

        def bwd_aten():
            z = bn_apply(y, mean, invstd, w, b)
            if act.output_derivable:  # the chain keeps the activation's output and differentiates from it
                gz = act.backward_from_output_(g.clone(), act(z, inplace=True))
            else:
                gz = act.backward_(g.clone(), z)
            return bn_backward(gz, y, w, mean, invstd, spec, (True, True, True))

        # (the ATen backward clones g: the chain's activation backward writes into a buffer it
        # owns; the clone's cost is subtracted below)
        def clone_only():
            return g.clone()

        fwd_f = lambda: fwd_c(y, w, b, 1e-5, act)  # noqa: E731
        bwd_f = lambda: bwd_c(g, y, w, b, mean, invstd, act)  # noqa: E731
        out_f = fwd_f()[0]
        ga, gf = bwd_aten(), bwd_f()
        diff = ((out_f - out_a).abs().max().item(), max((x - y_).abs().max().item() for x, y_ in zip(ga, gf)))
        times: Dict[str, List[float]] = {k: [] for k in ("fa", "ff", "ba", "bf", "c")}
        fns = {"fa": fwd_aten, "ff": fwd_f, "ba": bwd_aten, "bf": bwd_f, "c": clone_only}
        for r in range(args.rounds):
            keys = list(fns)
            for k in keys[r % len(keys):] + keys[: r % len(keys)]:
                times[k].append(timer(fns[k]))
        med = {k: statistics.median(v) for k, v in times.items()}
        med["ba"] -= med["c"]
        nbytes = y.numel() * y.element_size()
        (pa_f, pa_b), (pf_f, pf_b) = element_passes(False), element_passes(True)
        print(f"| {s} | {med['fa'] * 1e3:.2f} | {med['ff'] * 1e3:.2f} | {med['ff'] / med['fa']:.2f} | "
              f"{med['ba'] * 1e3:.2f} | {med['bf'] * 1e3:.2f} | {med['bf'] / med['ba']:.2f} | "
              f"{pa_f * nbytes / med['fa'] / 1e9:.1f} / {pa_b * nbytes / med['ba'] / 1e9:.1f} | "
              f"{pf_f * nbytes / med['ff'] / 1e9:.1f} / {pf_b * nbytes / med['bf'] / 1e9:.1f} | {diff[0]:.1e} / {diff[1]:.1e} |")


if __name__ == "__main__":
    main()
