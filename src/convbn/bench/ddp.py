"""Data-parallel benchmark: ``convbn bench --ddp N`` — SyncBatchNorm models under DistributedDataParallel.

:func:`launch_workers` starts ``N`` worker processes the way ``torchrun`` does (``spawn``;
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment;
``gloo`` on CPU, ``nccl`` on CUDA with one GPU per rank). Each rank builds the same model
(:func:`convbn.bench.models.build_model`, same seed), converts its BatchNorms with
``nn.SyncBatchNorm.convert_sync_batchnorm`` and trains every configuration below wrapped in
``DistributedDataParallel``, each fed this rank's own random batch (``--batch-size`` per rank):

* ``eager`` — the baseline; every ratio is to it. On CUDA it is the model with
  ``nn.SyncBatchNorm`` in plain eager PyTorch. ``nn.SyncBatchNorm`` only runs on CUDA
  (DDP refuses it on CPU), so on CPU ``eager`` is the unconverted model with per-process
  ``nn.BatchNorm`` (*local* statistics, no communication) and its row says so: it is
  the memory and speed of plain PyTorch, not the same maths;
* ``convbn SyncBatchNorm (unfused)`` — every ``nn.SyncBatchNorm`` swapped for
  :class:`convbn.nn.sync.SyncBatchNorm` (same parameters, statistics reduced over the
  group, CPU-capable) but nothing fused: the cost of synchronisation alone, and on CPU the
  reference the fused model's gradients are checked against;
* ``convert auto`` — :func:`convbn.convert` (``strategy="auto"``) of the SyncBatchNorm model:
  fused layers with cross-process statistics.

Measured per configuration and rank, then gathered on rank 0:

* **saved bytes** held for backward by one training forward of this rank
  (:class:`convbn.memory.track_saved` around the first step's forward, SPEC §3);
* **step time**: forward + loss + backward (DDP gradient all-reduce) + ``SGD.step()``,
  median over ``--steps`` timed rounds after ``--warmup`` untimed ones; the table shows
  the slowest rank's median (the rank every other one waits for);
* **max |Δgrad|**: largest difference of the first step's (DDP-averaged) gradients from
  the synchronised reference (``eager`` on CUDA, the unfused row on CPU), same weights,
  input and RNG;
* **rank Δparam / Δbuffer**: after the last step, the largest difference of parameters /
  floating buffers (running statistics) between any rank and rank 0. Parameters must agree
  (DDP); running statistics agree only where the statistics are synchronised.

Note: [Round-robin timing]
    As in :mod:`convbn.bench.training`, each round runs one step of every configuration with
    the order rotated by one per round; every timed step starts after a barrier so that the
    ranks enter their collectives together.

Started by ``torchrun`` instead (``RANK``/``WORLD_SIZE``/``MASTER_*`` already set), nothing is
launched: each process is one rank, the results are gathered and rank 0 prints the table.

Run::

    convbn bench --ddp 2 --model mnist --batch-size 32 --steps 5
    python -m convbn.bench.ddp --ddp 2 --model mnist --batch-size 32
    torchrun --nproc-per-node 2 -m convbn.bench.ddp --model mnist --batch-size 32
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from convbn.bench.common import first_tensor, fmt, projection_loss, rows_to_json, timed_ms, write_text
from convbn.bench.launch import default_backend, launch_workers, launched_by_torchrun
from convbn.bench.models import check_spec
from convbn.bench.table import markdown_table, print_rich_table
from convbn.memory import format_bytes
from convbn.passes.convert.rewrite import swap_sync_batchnorm

__all__ = [
    "DDPRow",
    "run_ddp_bench",
    "print_ddp_table",
    "add_ddp_arguments",
    "main_ddp",
    "rows_to_markdown",
    "rows_to_json",
    "DDP_CONFIGS",
]

#: Configuration names, in table order (``eager`` first: it is the baseline).
DDP_CONFIGS = ("eager", "convbn SyncBatchNorm (unfused)", "convert auto")


@dataclass
class DDPRow:
    """One (model, configuration) measurement over ``world_size`` ranks; ``None`` where not measured.

    Ratios are to the ``eager`` row of the same model and run (< 1: less memory / faster).
    """

    model: str
    config: str
    world_size: int
    input_shape: Tuple[int, ...]  # per rank
    device: str = "cpu"
    backend: str = "gloo"
    saved_bytes: Optional[int] = None  # largest over ranks
    saved_ratio: Optional[float] = None
    median_ms: Optional[float] = None  # slowest rank's median
    time_ratio: Optional[float] = None
    max_grad_diff: Optional[float] = None
    rank_param_diff: Optional[float] = None
    rank_buffer_diff: Optional[float] = None
    per_rank_saved: List[int] = field(default_factory=list)
    per_rank_ms: List[float] = field(default_factory=list)
    note: str = ""


# --------------------------------------------------------------------------- the benchmark


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


@dataclass
class _Config:
    name: str
    ddp: nn.Module
    params: List[Tensor]
    buffers: List[Tensor]
    optimizer: torch.optim.Optimizer
    note: str = ""


def _bench_worker(rank: int, world_size: int, spec: str, batch_size: int, steps: int, warmup: int, device_name: str,
                  seed: int, lr: float, threads: int) -> Dict[str, Any]:
    """One rank of :func:`run_ddp_bench`: returns this rank's measurements."""
    from convbn.bench.models import build_model
    from convbn.memory import track_saved

    torch.set_num_threads(threads)
    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.manual_seed(seed)
    base, shape = build_model(spec)  # same seed: same weights on every rank
    base = base.train()
    cfgs, reference = _worker_configs(base, device, lr)

    gen = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own data
    x = torch.randn(batch_size, *shape, generator=gen).to(device)
    with torch.no_grad():
        probe = first_tensor(copy.deepcopy(base).eval()(x[:1].cpu()))
    proj = torch.randn(probe.shape[1:], generator=torch.Generator().manual_seed(seed)).to(device)

    def step(cfg: _Config, saved: Optional[track_saved] = None) -> None:
        cfg.optimizer.zero_grad(set_to_none=True)
        if saved is None:
            out = first_tensor(cfg.ddp(x))
        else:
            with saved:
                out = first_tensor(cfg.ddp(x))
        projection_loss(out, proj).backward()
        cfg.optimizer.step()

    result: Dict[str, Any] = {"input_shape": tuple(x.shape), "configs": {}}
    grads: Dict[str, List[Optional[Tensor]]] = {}
    for cfg in cfgs:  # first step: saved bytes and gradients from identical weights, input and RNG
        torch.manual_seed(seed + 100 + rank)
        rec = track_saved()
        step(cfg, rec)
        grads[cfg.name] = [None if p.grad is None else p.grad.detach().double().cpu() for p in cfg.params]
        result["configs"][cfg.name] = {"saved_bytes": rec.result.total, "note": cfg.note, "times": []}
    ref = grads[reference]
    for cfg in cfgs:
        if cfg.name == reference or (cfg.name == "eager" and reference != "eager"):
            continue
        diffs = [float("inf") if (g is None) != (r is None) else 0.0 if g is None else (g - r).abs().max().item()
                 for g, r in zip(grads[cfg.name], ref)]
        result["configs"][cfg.name]["max_grad_diff"] = max(diffs, default=0.0)
    _worker_rounds(cfgs, step, warmup, timed=None, device=device)
    _worker_rounds(cfgs, step, steps, timed=result["configs"], device=device)
    _rank_agreement(cfgs, world_size, device, result["configs"])
    return result


def _worker_configs(base: nn.Module, device: torch.device, lr: float) -> Tuple[List[_Config], str]:
    """Eager, unfused SyncBatchNorm and converted copies of ``base``, each wrapped in DDP with
    its own SGD; and the name of the configuration the others' gradients are compared with."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from convbn.passes.convert.api import convert

    synced = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base)).to(device)
    n_bn = sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())
    # name -> (model, note, the unconverted module whose parameter order every config shares)
    models: Dict[str, Tuple[nn.Module, str, nn.Module]] = {}
    if device.type == "cuda":
        eager = copy.deepcopy(synced)
        models["eager"] = (eager, "nn.SyncBatchNorm", eager)
    else:
        eager = copy.deepcopy(base)
        models["eager"] = (eager, "nn.SyncBatchNorm is CUDA-only: per-process BatchNorm, local stats", eager)
    unfused = swap_sync_batchnorm(copy.deepcopy(synced), inplace=True)
    models[DDP_CONFIGS[1]] = (unfused, f"{n_bn} SyncBN, no fusion", unfused)
    before = copy.deepcopy(synced)
    fused = convert(before, strategy="auto")  # shares before's parameters (same objects, same order)
    report = getattr(fused, "convbn_report", None)
    models[DDP_CONFIGS[2]] = (fused, "" if report is None else f"{len(report.pairs)} pairs fused", before)
    cfgs: List[_Config] = []
    for name, (model, note, owner) in models.items():
        model = model.to(device)
        params, buffers = list(owner.parameters()), [b for b in model.buffers() if b.is_floating_point()]
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        cfgs.append(_Config(name, ddp, params, buffers, torch.optim.SGD(params, lr=lr), note))
    return cfgs, "eager" if device.type == "cuda" else DDP_CONFIGS[1]


def _worker_rounds(cfgs: List[_Config], step: Callable[[_Config], None], n: int,
                   timed: Optional[Dict[str, Dict[str, Any]]], device: torch.device) -> None:
    """``n`` rounds of one step of every configuration, ranks in step (see Note: [Round-robin
    timing]); with ``timed``, each step's milliseconds appended to its configuration's ``times``."""
    import torch.distributed as dist

    for r in range(n):
        k = r % len(cfgs)
        for cfg in cfgs[k:] + cfgs[:k]:
            dist.barrier()
            ms = timed_ms(lambda: step(cfg), device)
            if timed is not None:
                timed[cfg.name]["times"].append(ms)


def _rank_agreement(cfgs: List[_Config], world_size: int, device: torch.device,
                    results: Dict[str, Dict[str, Any]]) -> None:
    """Do the ranks agree? Each configuration's largest difference of any rank's parameters
    and buffers from rank 0's."""
    import torch.distributed as dist

    for cfg in cfgs:
        for key, tensors in (("rank_param_diff", cfg.params), ("rank_buffer_diff", cfg.buffers)):
            mine = _flat(tensors).to(device)
            everyone = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(everyone, mine)
            results[cfg.name][key] = max(((t - everyone[0]).abs().max().item() for t in everyone
                                          if t.numel()), default=0.0)


def run_ddp_bench(
    spec: str,
    world_size: int = 2,
    batch_size: int = 32,
    steps: int = 10,
    warmup: int = 2,
    device: str = "cpu",
    *,
    seed: int = 0,
    lr: float = 1e-3,
    threads: Optional[int] = None,
    timeout: float = 600.0,
) -> List[DDPRow]:
    """Benchmark ``spec`` under DDP with SyncBatchNorm on ``world_size`` processes (see the module docstring).

    Args:
        spec: a model spec (:func:`convbn.bench.models.build_model`), e.g. ``"mnist"``.
        world_size: number of processes (one GPU each on CUDA).
        batch_size: samples per rank.
        steps: timed rounds (median reported); ``warmup``: untimed rounds before them.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
        seed: seed of the weights, data and dropout.
        lr: SGD learning rate.
        threads: torch threads per rank (default: the CPUs divided among the ranks).
        timeout: seconds before the workers are stopped.

    Returns:
        One :class:`DDPRow` per configuration of :data:`DDP_CONFIGS`, ``eager`` first.

    Raises:
        ValueError: bad counts, or more CUDA ranks than GPUs.
        RuntimeError: a worker failed (with its traceback).
    """
    if world_size < 1 or batch_size < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"need world_size >= 1, batch_size >= 1, steps >= 1 and warmup >= 0, but got "
                         f"world_size={world_size}, batch_size={batch_size}, steps={steps}, warmup={warmup}")
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', but got device={device!r}")
    from convbn.bench.models import build_model, check_input

    model, shape = build_model(spec)  # a bad spec or a missing package fails here, before any process starts
    check_input(model, torch.randn(batch_size, *shape), spec, "give the model its default input shape")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    bench_args = (spec, batch_size, steps, warmup, device, seed, lr, threads)
    if launched_by_torchrun():
        results = _run_in_this_group(world_size, bench_args)
    else:
        results = launch_workers(_bench_worker, world_size, *bench_args, device=device, timeout=timeout)
    return _rows(spec, world_size, device, results)


def _rows(spec: str, world_size: int, device: str, results: List[Dict[str, Any]]) -> List[DDPRow]:
    """One row per configuration from every rank's measurements: the worst rank's figures,
    ratios to eager."""
    rows: List[DDPRow] = []
    backend = default_backend(device)
    for name in DDP_CONFIGS:
        per = [r["configs"][name] for r in results]
        row = DDPRow(spec, name, world_size, results[0]["input_shape"], str(device), backend, note=per[0]["note"])
        row.per_rank_saved = [p["saved_bytes"] for p in per]
        row.per_rank_ms = [statistics.median(p["times"]) for p in per]
        row.saved_bytes = max(row.per_rank_saved)
        row.median_ms = max(row.per_rank_ms)
        if "max_grad_diff" in per[0]:
            row.max_grad_diff = max(p["max_grad_diff"] for p in per)
        row.rank_param_diff = max(p["rank_param_diff"] for p in per)
        row.rank_buffer_diff = max(p["rank_buffer_diff"] for p in per)
        if len(set(row.per_rank_saved)) > 1:
            row.note += f"{'; ' if row.note else ''}saved bytes differ across ranks"
        rows.append(row)
    eager = rows[0]
    for row in rows:
        if row.saved_bytes is not None and eager.saved_bytes:
            row.saved_ratio = row.saved_bytes / eager.saved_bytes
        if row.median_ms is not None and eager.median_ms:
            row.time_ratio = row.median_ms / eager.median_ms
    return rows


def _run_in_this_group(world_size: int, bench_args: Tuple[Any, ...]) -> List[Dict[str, Any]]:
    """Run this rank's share of the benchmark in the current job (``torchrun``); every rank gets all results."""
    import torch.distributed as dist

    device = bench_args[4]
    created = not dist.is_initialized()
    if created:
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(default_backend(device))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if world != world_size:
            raise ValueError(f"--ddp {world_size} does not match this job's WORLD_SIZE={world}; "
                             f"leave --ddp out under torchrun or give the same number")
        everyone: List[Any] = [None] * world
        dist.all_gather_object(everyone, _bench_worker(rank, world, *bench_args))
        return everyone
    finally:
        if created:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- output


_HEADERS = ["model", "config", "ranks", "input/rank", "saved/rank", "saved ratio", "step ms", "time ratio",
            "max |Δgrad|", "rank Δparam", "rank Δbuffer", "note"]
_RIGHT = set(_HEADERS[2:11]) - {"input/rank"}


def _cells(row: DDPRow) -> List[str]:
    return [
        row.model,
        row.config,
        str(row.world_size),
        "x".join(map(str, row.input_shape)),
        "n/a" if row.saved_bytes is None else format_bytes(row.saved_bytes),
        fmt(row.saved_ratio, ".3f"),
        fmt(row.median_ms, ".1f"),
        fmt(row.time_ratio, ".2f"),
        fmt(row.max_grad_diff, ".1e"),
        fmt(row.rank_param_diff, ".1e"),
        fmt(row.rank_buffer_diff, ".1e"),
        row.note,
    ]


def rows_to_markdown(rows: Sequence[DDPRow]) -> str:
    """The rows as a GitHub markdown table."""
    return markdown_table(_HEADERS, _RIGHT, [_cells(r) for r in rows])


def print_ddp_table(rows: Sequence[DDPRow], title: Optional[str] = None) -> None:
    """Print the rows as a rich table."""
    where = ", ".join(sorted({f"{r.world_size} x {r.device} ({r.backend})" for r in rows}))
    title = title or (f"DDP training step (forward + backward + all-reduce + SGD) with SyncBatchNorm: "
                      f"eager vs convbn.convert, {where}")
    print_rich_table(_HEADERS, _RIGHT, [_cells(r) for r in rows], title)


# --------------------------------------------------------------------------- command line


def add_ddp_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--ddp N`` and the options it uses to ``parser``.

    Options another benchmark already added to the same parser (``--model``, ``--batch-size``,
    ``--steps``, ``--warmup``, ``--device`` of :func:`convbn.bench.training.add_training_arguments`)
    are shared, not added twice.
    """
    existing = set(parser._option_string_actions)

    def add(flag: str, **kwargs: Any) -> None:
        if flag not in existing:
            parser.add_argument(flag, **kwargs)

    from convbn.cli import batch_size, device_arg, non_negative_int, output_path, positive_int

    add("--ddp", type=positive_int, default=None, metavar="N",
        help="run the data-parallel SyncBatchNorm benchmark on N processes (gloo on CPU, nccl on CUDA)")
    add("--model", action="append", default=None, metavar="SPEC",
        help="model spec or module:callable, repeatable (default: mnist)")
    add("--batch-size", type=batch_size, default=64, help="batch size (per rank with --ddp)")
    add("--steps", type=positive_int, default=10, help="timed rounds (median reported)")
    add("--warmup", type=non_negative_int, default=2, help="untimed rounds before the timed ones")
    add("--device", type=device_arg, default="cpu", help="torch device: cpu or cuda")
    add("--json", type=output_path, nargs="?", const="-", default=None, metavar="PATH",
        help="write the rows as JSON to PATH (no PATH or '-': stdout)")
    add("--markdown", type=output_path, nargs="?", const="-", default=None, metavar="PATH",
        help="write the table as markdown to PATH (no PATH or '-': stdout)")
    return parser


def main_ddp(args: argparse.Namespace) -> int:
    """Run the DDP benchmark from parsed arguments (``args.ddp`` processes) and print the table.

    Returns an exit code: 0; 2 with a message on stderr for a bad spec or option; 1 when a
    worker failed (its traceback on stderr).
    """
    torchrun = launched_by_torchrun()
    default = int(os.environ.get("WORLD_SIZE", 2)) if torchrun else 2
    world_size = default if getattr(args, "ddp", None) is None else int(args.ddp)
    models = getattr(args, "model", None) or ["mnist"]
    if isinstance(models, str):
        models = [models]
    rows: List[DDPRow] = []
    try:
        for spec in models:  # a bad spec fails before any process starts
            check_spec(spec)
        for spec in models:
            rows += run_ddp_bench(spec, world_size, args.batch_size, args.steps, args.warmup, args.device,
                                  seed=getattr(args, "seed", 0), lr=getattr(args, "lr", 1e-3),
                                  threads=getattr(args, "threads", None))
    except (ValueError, ImportError) as exc:
        print(f"convbn bench --ddp: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a worker failed: its traceback is in the message
        print(f"convbn bench --ddp: {exc}", file=sys.stderr)
        return 1
    if not torchrun or int(os.environ.get("RANK", "0")) == 0:  # one table per job
        print_ddp_table(rows)
        if getattr(args, "markdown", None):
            write_text(args.markdown, rows_to_markdown(rows))
        if getattr(args, "json", None):
            write_text(args.json, rows_to_json(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main_ddp(add_ddp_arguments(argparse.ArgumentParser(description=__doc__)).parse_args()))
