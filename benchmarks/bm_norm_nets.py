"""Peak and step time of real per-sample-norm networks: convbn against checkpointing and torch.compile.

Three networks nobody in this project wrote (issue 39's targets):

* ``diffusion``: a diffusion U-Net, ``diffusers`` ``UNet2DModel`` (ResBlocks GroupNorm -> SiLU ->
  Conv, pre-activation), called as a training script does (``model(x, t).sample``);
* ``unet3d``: a 3-D U-Net, MONAI ``BasicUNet`` (Conv -> InstanceNorm -> LeakyReLU, 2-D / 3-D
  nnU-Net-style blocks);
* ``convnext``: a ConvNeXt classifier, timm ``convnext_atto`` (depthwise conv -> LayerNorm over
  channels -> MLP);
* ``bit``: a BiT ResNet, timm ``resnetv2_50x1_bit`` (weight-standardised ``StdConv2d`` ->
  ``GroupNormAct``, pre-activation; the convs' weights computed in forward).

Configurations, each a deep copy of the same seeded model:

* ``eager``; ``convert`` (:func:`convbn.convert` with ``example_inputs``, the default plan);
  ``convert lowest peak`` (``peak_budget=0.01``: the lowest peak the planner reaches);
* ``checkpoint per block``: non-reentrant :func:`torch.utils.checkpoint.checkpoint` around each
  block named in :data:`NETS` (:func:`convbn.bench.checkpoint_blocks`);
* with ``--compile``: ``torch.compile`` (inductor) and ``torch.compile budget=0.5`` (the
  partitioner's ``activation_memory_budget``).

Measured (the standard loop: ``zero_grad(set_to_none=True)``, forward, mean loss, backward,
``SGD.step()``):

* **peak**: exact live-tensor bytes above what is live after ``zero_grad``, weight gradients
  counted (:func:`convbn.memory.timeline`, the one definition); **allocator peak**: the same
  step by the CPU allocator (:func:`convbn.memory.allocator_peak`: the kernels' own scratch too,
  issue 39's meter), not for compiled configurations; compiled graphs run outside
  Python dispatch, so their peak is sampled process RSS (:class:`convbn.memory.peak_memory`,
  freed heap pages returned to the OS first) and their ratio is to eager's RSS measured the
  same way in the same run;
* **step ms**: median over interleaved rounds (each round one step of every configuration, the
  order rotated per round) after warm-up, thread CPU time with one intra-op thread (else wall
  time); ratio to eager's median in the same run;
* **norms fused**: per-sample norm modules the eager step calls that the configuration's report
  lists as fused and its step no longer calls as modules (they ran inside a fused chain).

The model factory and conversion are set up untimed. Run::

    python benchmarks/bm_norm_nets.py                        # the three networks
    python benchmarks/bm_norm_nets.py --nets convnext --compile --rounds 5
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)
from sweep_norm_libs import norm_hooks  # noqa: E402
from zoo import import_torchvision_without_fake_kernels  # noqa: E402

import convbn  # noqa: E402
from convbn.bench.checkpointing import checkpoint_blocks  # noqa: E402
from convbn.bench.training_configs import budget_backend  # noqa: E402
from convbn.bench.training_run import _release_freed_memory  # noqa: E402
from convbn.memory import allocator_peak, peak_memory, timeline  # noqa: E402

__all__ = ["NETS", "Config", "build_configs", "measure", "main"]

Net = Tuple[nn.Module, Tuple[torch.Tensor, ...], List[str]]


class DiffusionStep(nn.Module):
    """``unet(x, t).sample`` for a fixed batch of timesteps: the call a diffusion training
    step makes, with one tensor in and one out."""

    def __init__(self, unet: nn.Module, timesteps: torch.Tensor) -> None:
        super().__init__()
        self.unet = unet
        self.register_buffer("timesteps", timesteps, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unet(x, self.timesteps, return_dict=False)[0]


def _diffusion(batch: int) -> Net:
    from diffusers import UNet2DModel

    unet = UNet2DModel(sample_size=64, in_channels=3, out_channels=3, block_out_channels=(32, 64, 128),
                       down_block_types=("DownBlock2D",) * 3, up_block_types=("UpBlock2D",) * 3,
                       layers_per_block=2, norm_num_groups=16)
    model = DiffusionStep(unet, torch.arange(batch) * 97 % 1000)
    # each ResBlock, as diffusers' own gradient checkpointing does (the up blocks' ``resnets`` are
    # read by UNet2DModel.forward, so the blocks themselves cannot be wrapped)
    blocks = [f"unet.{n}" for n, m in unet.named_modules() if type(m).__name__ == "ResnetBlock2D"]
    return model, (torch.randn(batch, 3, 64, 64),), blocks


def _unet3d(batch: int) -> Net:
    from monai.networks.nets import BasicUNet

    model = BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(16, 16, 32, 64, 128, 16))
    blocks = ["conv_0", "down_1", "down_2", "down_3", "down_4", "upcat_4", "upcat_3", "upcat_2", "upcat_1"]
    return model, (torch.randn(batch, 1, 48, 48, 48),), blocks


def _convnext(batch: int) -> Net:
    import timm

    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10)
    return model, (torch.randn(batch, 3, 128, 128),), ["stem"] + [f"stages.{i}" for i in range(4)]


def _bit(batch: int) -> Net:
    import timm

    model = timm.create_model("resnetv2_50x1_bit", pretrained=False, num_classes=10)
    return model, (torch.randn(batch, 3, 128, 128),), ["stem"] + [f"stages.{i}" for i in range(4)]


#: name -> (factory(batch) -> (model, inputs, checkpoint blocks), default batch, label)
NETS: Dict[str, Tuple[Callable[[int], Net], int, str]] = {
    "diffusion": (_diffusion, 4, "diffusers UNet2DModel (GroupNorm -> SiLU -> Conv), 64x64"),
    "unet3d": (_unet3d, 2, "MONAI BasicUNet 3-D (Conv -> InstanceNorm -> LeakyReLU), 48^3"),
    "convnext": (_convnext, 8, "timm convnext_atto (dwconv -> LayerNorm -> MLP), 128x128"),
    "bit": (_bit, 8, "timm resnetv2_50x1_bit (StdConv2d -> GroupNorm -> ReLU, pre-activation), 128x128"),
}


@dataclass
class Config:
    """One configuration: its model (a deep copy), its optimizer and what was measured."""

    name: str
    model: nn.Module
    compiled: bool = False
    optimizer: Optional[torch.optim.Optimizer] = None
    times: List[float] = field(default_factory=list)
    peak: Optional[int] = None
    alloc: Optional[int] = None
    rss: Optional[int] = None
    fused: Optional[int] = None
    error: str = ""


def _loss(out: Any) -> torch.Tensor:
    return (out if isinstance(out, torch.Tensor) else out[0]).float().mean()


def build_configs(base: nn.Module, x: Tuple[torch.Tensor, ...], blocks: List[str],
                  use_compile: bool, several_computed: bool = False) -> List[Config]:
    """The configurations of one network (untimed set-up); ``several_computed``: add ``convert``
    with chains taking several computed-weight convolutions (Note: [one computed weight per
    chain] in convbn/passes/convert/match.py switched off while converting)."""
    def converted(**kw: Any) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a peak_budget below the floor warns: the lowest peak is asked
            return convbn.convert(copy.deepcopy(base), example_inputs=x, **kw)

    makers: List[Tuple[str, Callable[[], nn.Module], bool]] = [
        ("eager", lambda: copy.deepcopy(base), False),
        ("convert", converted, False),
        ("convert lowest peak", lambda: converted(peak_budget=0.01), False),
        ("checkpoint per block", lambda: checkpoint_blocks(copy.deepcopy(base), blocks), False),
    ]
    if several_computed:
        makers.append(("convert, several computed weights per chain", lambda: _several_computed(converted), False))
    if use_compile:
        makers += [("torch.compile", lambda: torch.compile(copy.deepcopy(base)), True),
                   ("torch.compile budget=0.5", lambda: torch.compile(copy.deepcopy(base),
                                                                       backend=budget_backend(0.5)), True)]
    cfgs = []
    for name, make, compiled in makers:
        torch.manual_seed(0)
        try:
            model = make().train()
            cfgs.append(Config(name, model, compiled, torch.optim.SGD(model.parameters(), lr=1e-3)))
        except Exception as exc:  # noqa: BLE001 - the row says why
            cfgs.append(Config(name, nn.Identity(), compiled, error=f"{type(exc).__name__}: {exc}"[:160]))
    return cfgs


def _several_computed(converted: Callable[[], nn.Module]) -> nn.Module:
    """``converted()`` with the one-computed-weight-per-chain rule off."""
    from convbn.passes.convert import match

    rule = match._computes_weight
    match._computes_weight = lambda chain: False
    try:
        return converted()
    finally:
        match._computes_weight = rule


def _step(cfg: Config, x: Tuple[torch.Tensor, ...]) -> None:
    if cfg.optimizer is None:
        raise RuntimeError(f"{cfg.name} has no optimizer: it failed to build ({cfg.error})")
    cfg.optimizer.zero_grad(set_to_none=True)
    _loss(cfg.model(*x)).backward()
    cfg.optimizer.step()


def _rss_peak(cfg: Config, x: Tuple[torch.Tensor, ...]) -> int:
    cfg.model.zero_grad(set_to_none=True)  # as timeline: freed gradients are not the step's
    _release_freed_memory(torch.device("cpu"))  # freed heap pages back to the OS: RSS starts from a floor
    with peak_memory("cpu") as meter:
        _step(cfg, x)
    return int(meter.result.peak)


def _first_steps(cfgs: List[Config], x: Tuple[torch.Tensor, ...], warmup: int) -> None:
    """First calls (checks, plans, compilation) and warm-up, untimed; norms fused counted on
    the last warm-up step against eager's."""
    called: Dict[str, Dict[str, str]] = {}
    for r in range(1 + warmup):
        for cfg in cfgs:
            if cfg.error:
                continue
            hooks: List[Any] = []
            if r == warmup and (cfg.name == "eager" or cfg.name.startswith("convert")):
                called[cfg.name], hooks = norm_hooks(cfg.model)
            try:
                _step(cfg, x)
            except Exception as exc:  # noqa: BLE001 - the row says why
                cfg.error = f"{type(exc).__name__}: {exc}"[:160]
            finally:
                for h in hooks:
                    h.remove()
    eager = called.get("eager", {})
    for cfg in cfgs:
        report = getattr(cfg.model, "convbn_report", None)
        if cfg.name in called and report is not None:
            fused = {o.batchnorm.rpartition(" in ")[2] for o in report.outcomes if o.result == "fused"}
            cfg.fused = sum(1 for n in eager if n not in called[cfg.name] and n in fused)


def measure(cfgs: List[Config], x: Tuple[torch.Tensor, ...], rounds: int, warmup: int) -> None:
    """Peaks (exact, or RSS for compiled graphs and eager beside them) and interleaved step times."""
    _first_steps(cfgs, x, warmup)
    live = [c for c in cfgs if not c.error]
    for cfg in live:
        if not cfg.compiled:
            gc.collect()
            cfg.peak = timeline(cfg.model, *x, loss_fn=_loss, optimizer=cfg.optimizer).peak
            cfg.model.zero_grad(set_to_none=True)  # as timeline: freed gradients are not the step's
            cfg.alloc = allocator_peak(lambda: _step(cfg, x))
    if any(c.compiled for c in live):
        for cfg in live:
            if cfg.compiled or cfg.name == "eager":
                cfg.rss = _rss_peak(cfg, x)
    # thread CPU time with one intra-op thread (the rest of a loaded machine does not count)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for r in range(rounds):
        k = r % len(live)
        for cfg in live[k:] + live[:k]:
            t0 = clock()
            _step(cfg, x)
            cfg.times.append(clock() - t0)


def table(label: str, cfgs: List[Config], norms: int) -> str:
    """The printed markdown table of one network (``norms``: norm modules eager's step calls)."""
    eager = next(c for c in cfgs if c.name == "eager")
    et = statistics.median(eager.times) if eager.times else float("nan")
    lines = [f"**{label}** (norm modules called by eager: {norms})", "",
             "| configuration | peak MiB | peak x eager | allocator peak MiB (x eager) | step ms | time x eager "
             "| norms fused and running |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c in cfgs:
        if c.error:
            lines.append(f"| {c.name} | failed: {c.error} | | | | | |")
            continue
        if c.compiled:
            peak = f"{c.rss / 2**20:.1f} (RSS)" if c.rss is not None else "-"
            ratio = f"{c.rss / eager.rss:.2f} (RSS)" if c.rss and eager.rss else "-"
        else:
            peak = f"{c.peak / 2**20:.1f}" if c.peak is not None else "-"
            ratio = f"{c.peak / eager.peak:.2f}" if c.peak is not None and eager.peak else "-"
        alloc = "-" if c.alloc is None or not eager.alloc else f"{c.alloc / 2**20:.1f} ({c.alloc / eager.alloc:.3f})"
        ms = statistics.median(c.times) * 1e3 if c.times else float("nan")
        fused = "-" if c.fused is None else str(c.fused)
        lines.append(f"| {c.name} | {peak} | {ratio} | {alloc} | {ms:.0f} | {ms / (et * 1e3):.2f} | {fused} |")
    return "\n".join(lines)


def _count_eager_norms(model: nn.Module, x: Tuple[torch.Tensor, ...]) -> int:
    called, hooks = norm_hooks(model)
    try:
        _loss(model(*x)).backward()
    finally:
        for h in hooks:
            h.remove()
    model.zero_grad(set_to_none=True)
    return len(called)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", nargs="*", choices=list(NETS), default=list(NETS))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one step of every configuration)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds after the first step")
    parser.add_argument("--batch", type=int, help="batch size (default: the network's)")
    parser.add_argument("--compile", action="store_true", help="add torch.compile and its 0.5 budget")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--several-computed", action="store_true",
                        help="add convert with chains taking several computed-weight convolutions (BiT)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import_torchvision_without_fake_kernels()
    print(f"Command: `python benchmarks/bm_norm_nets.py {' '.join(sys.argv[1:] if argv is None else argv)}`"
          f" (torch {torch.__version__}, {args.threads} thread(s), convbn {convbn.__version__})\n")
    for name in args.nets:
        factory, batch, label = NETS[name]
        torch.manual_seed(0)
        base, x, blocks = factory(args.batch or batch)
        base.train()
        norms = _count_eager_norms(copy.deepcopy(base), x)
        cfgs = build_configs(base, x, blocks, args.compile, args.several_computed)
        measure(cfgs, x, args.rounds, args.warmup)
        print(table(f"{label}, batch {x[0].shape[0]}", cfgs, norms) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
