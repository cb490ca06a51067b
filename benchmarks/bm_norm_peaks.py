"""Per-sample norm nets (issue 39): a training step's peak and time, eager vs convert vs per-block checkpointing.

Three nets written here in the shape their families use (no library needed):

* a diffusion-style U-Net: ResBlocks of GroupNorm -> SiLU -> Conv (pre-activation), twice, plus
  the skip, at two resolutions;
* a 3-D InstanceNorm U-Net: Conv -> InstanceNorm3d(affine) -> LeakyReLU, twice per stage;
* a ConvNeXt-style net: depthwise 7x7 conv -> LayerNorm2d over channels -> 1x1 conv -> GELU ->
  1x1 conv, plus the skip.

Peak: :func:`convbn.memory.timeline` (the standard loop: zero_grad(set_to_none=True), forward,
mean loss, backward, SGD step; exact live tensor bytes on CPU). Time: forward + backward + step,
thread CPU time (one intra-op thread), median of ``--rounds`` interleaved rounds (the order
reversed every other round), as a ratio to eager's in the same process. The planner's predicted
peak of ``convert`` is printed beside the measured one.

    python benchmarks/bm_norm_peaks.py [--rounds 5]

``--amp``: every variant's step under ``torch.autocast("cpu", dtype=torch.bfloat16)``, as
fractions of eager autocast's peak and time. ``--compile``: ``torch.compile`` (inductor,
``fullgraph``, channels_last input) of the eager net and of the converted one: the bytes the
compiled forward keeps for backward (:func:`convbn.memory.saved_bytes`, exact: compiled
graphs' own buffers are not seen by the live-tensor meters) and the step time, as fractions of
compiled eager's; the step's peak (zero_grad, forward, loss, backward, SGD step) by
:func:`convbn.memory.allocator_peak` (the allocator's events, which compiled code's buffers
reach). ``--nets`` picks nets by the start of their label (``diffusion 3-D``).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import convbn
from convbn.memory import allocator_peak, saved_bytes, timeline


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class DiffusionUNet(nn.Module):
    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.ModuleList([ResBlock(c, c), ResBlock(c, c)])
        self.pool = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = nn.ModuleList([ResBlock(2 * c, 2 * c), ResBlock(2 * c, 2 * c)])
        self.upc = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.up = nn.ModuleList([ResBlock(2 * c, c), ResBlock(c, c)])
        self.out_norm, self.out = nn.GroupNorm(8, c), nn.Conv2d(c, 3, 3, padding=1)

    def blocks(self) -> List[nn.Module]:
        return [*self.down, *self.mid, *self.up]

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for b in self.down:
            h = b(h)
        s = h
        h = self.pool(h)
        for b in self.mid:
            h = b(h)
        h = torch.cat([self.upc(h), s], 1)
        for b in self.up:
            h = b(h)
        return self.out(F.silu(self.out_norm(h)))


class INStage(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv3d(cin, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True)
        self.conv2, self.norm2 = nn.Conv3d(cout, cout, 3, padding=1), nn.InstanceNorm3d(cout, affine=True)

    def forward(self, x: Tensor) -> Tensor:
        x = F.leaky_relu(self.norm1(self.conv1(x)), 0.01)
        return F.leaky_relu(self.norm2(self.conv2(x)), 0.01)


class InstanceUNet3d(nn.Module):
    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.enc1, self.enc2 = INStage(1, c), INStage(c, 2 * c)
        self.pool = nn.MaxPool3d(2)
        self.upc = nn.ConvTranspose3d(2 * c, c, 2, stride=2)
        self.dec = INStage(2 * c, c)
        self.head = nn.Conv3d(c, 2, 1)

    def blocks(self) -> List[nn.Module]:
        return [self.enc1, self.enc2, self.dec]

    def forward(self, x: Tensor) -> Tensor:
        s = self.enc1(x)
        h = self.enc2(self.pool(s))
        return self.head(self.dec(torch.cat([self.upc(h), s], 1)))


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw, self.norm = nn.Conv2d(c, c, 7, padding=3, groups=c), LayerNorm2d(c)
        self.pw1, self.pw2 = nn.Conv2d(c, 4 * c, 1), nn.Conv2d(4 * c, c, 1)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))


class ConvNeXtNet(nn.Module):
    def __init__(self, c: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 4, stride=4)
        self.stage = nn.ModuleList([ConvNeXtBlock(c) for _ in range(depth)])
        self.head = nn.Linear(c, 10)

    def blocks(self) -> List[nn.Module]:
        return list(self.stage)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for b in self.stage:
            h = b(h)
        return self.head(h.mean((2, 3)))


class Checkpointed(nn.Module):
    """Each block under ``torch.utils.checkpoint`` (non-reentrant)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def checkpointed(model: nn.Module) -> nn.Module:
    m = copy.deepcopy(model)
    for parent in list(m.modules()):
        for name, child in list(parent.named_children()):
            if any(child is b for b in m.blocks()):  # type: ignore[operator]
                setattr(parent, name, Checkpointed(child))
    return m


#: (label, factory, input shape, issue 39's peak target as a fraction of eager's)
MODELS: List[Tuple[str, Callable[[], nn.Module], Tuple[int, ...], float]] = [
    ("diffusion U-Net (GroupNorm -> SiLU -> Conv)", DiffusionUNet, (4, 3, 64, 64), 0.5),
    ("3-D U-Net (Conv -> InstanceNorm3d -> LeakyReLU)", InstanceUNet3d, (2, 1, 32, 32, 32), 0.5),
    ("ConvNeXt-style (dwconv -> LayerNorm2d -> MLP)", ConvNeXtNet, (8, 3, 128, 128), 0.7),
]


def _loss(out: Tensor) -> Tensor:
    return out.float().mean()


class Autocast(nn.Module):
    """``model`` called under bf16 CPU autocast (the loss and the step outside it, as usual)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x)


def _peak(model: nn.Module, x: Tensor) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return timeline(model, x, loss_fn=_loss, optimizer=opt).peak


def _clock() -> float:
    """Thread CPU time with one intra-op thread (forward and backward both run on the calling
    thread on the CPU: the rest of a loaded machine does not count), else wall time."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _step_time(model: nn.Module, x: Tensor, opt: torch.optim.Optimizer) -> float:
    t0 = _clock()
    opt.zero_grad(set_to_none=True)
    _loss(model(x)).backward()
    opt.step()
    return _clock() - t0


def _times(variants: Dict[str, nn.Module], x: Tensor, rounds: int) -> Dict[str, float]:
    """Median step time of each variant over interleaved rounds (after one warm-up step each)."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in variants.items()}
    times: Dict[str, List[float]] = {k: [] for k in variants}
    for k, m in variants.items():  # warm-up (and, compiled, the compile)
        _step_time(m, x, opts[k])
    order = list(variants)
    for r in range(rounds):  # interleaved rounds, the order reversed every other round
        for k in (order if r % 2 == 0 else order[::-1]):
            times[k].append(_step_time(variants[k], x, opts[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def measure(make: Callable[[], nn.Module], shape: Tuple[int, ...], rounds: int,
            amp: bool = False, target: float = 0.5) -> Dict[str, Tuple[float, float]]:
    """``{variant: (peak ratio to eager, time ratio to eager)}`` and eager's peak in MiB under
    ``"eager MiB"``; ``"budget"`` is convert asked for the least recompute within ``target`` of
    eager's peak (``peak_budget``)."""
    torch.manual_seed(0)
    eager = make()
    x = torch.randn(shape)
    variants = {"eager": eager, "convert": convbn.convert(copy.deepcopy(eager), example_inputs=(x,)),
                "budget": convbn.convert(copy.deepcopy(eager), example_inputs=(x,), peak_budget=target),
                "checkpoint": checkpointed(eager)}
    if amp:
        variants = {k: Autocast(m) for k, m in variants.items()}
    peaks = {k: _peak(m, x) for k, m in variants.items()}
    med = _times(variants, x, rounds)
    out = {k: (peaks[k] / peaks["eager"], med[k] / med["eager"]) for k in variants}
    out["eager MiB"] = (peaks["eager"] / 2**20, med["eager"])
    out["convert MiB"] = (peaks["convert"] / 2**20, _predicted(variants["convert"]) / 2**20)
    return out


def _predicted(model: nn.Module) -> int:
    """The planner's predicted step peak of a converted model (its report's), 0 where none."""
    report = getattr(model, "convbn_report", None) or getattr(getattr(model, "model", None), "convbn_report", None)
    return int(getattr(report, "predicted_peak_bytes", 0) or 0)


def _kept(model: nn.Module, x: Tensor) -> int:
    """Bytes of the batch-sized tensors a training forward of ``model`` keeps for backward."""
    return sum(b for _, sh, _, b in saved_bytes(model, x).shapes if len(sh) > 1 and sh[0] == x.shape[0])


def _weight_copies(model: nn.Module, x: Tensor) -> int:
    """Bytes of the saved tensors shaped like one of ``model``'s conv weights that are not the
    parameter (inductor's channels_last weight copies, Note: [a conv inductor cannot re-layout])."""
    saved = saved_bytes(model, x)
    weights = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d))}
    return sum(b for (_, sh, _, b), p in zip(saved.shapes, saved.is_param) if not p and tuple(sh) in weights)


def measure_compiled(make: Callable[[], nn.Module], shape: Tuple[int, ...], rounds: int) -> Dict[str, float]:
    """Compiled eager against compiled convert: kept MiB of each and the time ratio."""
    torch.manual_seed(0)
    eager = make()
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last if len(shape) == 4
                                      else torch.channels_last_3d)
    fast = convbn.convert(copy.deepcopy(eager), example_inputs=(x,))
    variants = {"compiled eager": torch.compile(eager, fullgraph=True),
                "compiled convert": torch.compile(fast, fullgraph=True)}
    med = _times(variants, x, rounds)  # compiles first: the kept bytes are the compiled graphs'
    kept = {k: _kept(m, x) for k, m in variants.items()}
    copies = {k: _weight_copies(m, x) for k, m in variants.items()}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in variants.items()}
    peak = {k: allocator_peak(lambda: _step_time(m, x, opts[k])) for k, m in variants.items()}
    return {"eager kept MiB": kept["compiled eager"] / 2**20, "convert kept MiB": kept["compiled convert"] / 2**20,
            "uncompiled convert kept MiB": _kept(fast, x) / 2**20, "eager peak MiB": peak["compiled eager"] / 2**20,
            "eager copies KiB": copies["compiled eager"] / 2**10, "convert copies KiB": copies["compiled convert"] / 2**10,
            "peak": peak["compiled convert"] / peak["compiled eager"], "convert peak MiB": peak["compiled convert"] / 2**20,
            "time": med["compiled convert"] / med["compiled eager"]}


def _print_compiled(models: List[Tuple[str, Callable[[], nn.Module], Tuple[int, ...]]], rounds: int) -> None:
    print("| net (input, channels_last) | compiled eager: kept MiB | compiled convert: kept MiB (x) | "
          "convert uncompiled: kept MiB | conv weight copies kept, KiB: compiled eager / convert | "
          "compiled eager: step peak MiB | compiled convert: step peak MiB (x) / time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, make, shape in models:
        r = measure_compiled(make, shape, rounds)
        print(f"| {label} {tuple(shape)} | {r['eager kept MiB']:.1f} | {r['convert kept MiB']:.1f} "
              f"({r['convert kept MiB'] / r['eager kept MiB']:.2f}x) | {r['uncompiled convert kept MiB']:.1f} "
              f"| {r['eager copies KiB']:.1f} / {r['convert copies KiB']:.1f} | {r['eager peak MiB']:.2f} "
              f"| {r['convert peak MiB']:.2f} ({r['peak']:.3f}x) / {r['time']:.2f}x |", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--amp", action="store_true", help="every step under bf16 CPU autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile of eager and of convert")
    parser.add_argument("--nets", nargs="*", default=None, help="nets whose label starts with one of these")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models = [m for m in MODELS if args.nets is None or any(m[0].startswith(n) for n in args.nets)]
    if args.compile:
        _print_compiled([m[:3] for m in models], args.rounds)
        return 0
    amp = " (bf16 autocast)" if args.amp else ""
    print(f"| net (input){amp} | eager peak MiB | convert peak MiB: measured / predicted | convert peak / time "
          "| convert peak_budget=target: peak / time | checkpoint peak / time |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, make, shape, target in models:
        r = measure(make, shape, args.rounds, args.amp, target)
        print(f"| {label} {tuple(shape)} | {r['eager MiB'][0]:.1f} | {r['convert MiB'][0]:.2f} / {r['convert MiB'][1]:.2f} "
              f"| {r['convert'][0]:.2f}x / {r['convert'][1]:.3f}x "
              f"| {target} -> {r['budget'][0]:.2f}x / {r['budget'][1]:.3f}x "
              f"| {r['checkpoint'][0]:.2f}x / {r['checkpoint'][1]:.3f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
