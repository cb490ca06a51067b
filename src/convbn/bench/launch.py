"""Starting a distributed job on this machine: ``spawn``ed ranks with a process group, like ``torchrun``.

:func:`launch_workers` runs a function on N fresh processes and returns each rank's
result (the data-parallel benchmark and the distributed tests use it);
:func:`launched_by_torchrun` tells whether this process already is one rank of a job.
"""
from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

__all__ = ["default_backend", "find_free_port", "launch_workers", "launched_by_torchrun"]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_backend(device: str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _worker_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, device: str,
                 out_dir: str, args: Tuple[Any, ...], timeout_s: float) -> None:
    """Entry point of one spawned rank: torchrun's environment, the process group, ``fn``, the result file."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    path = os.path.join(out_dir, f"rank{rank}.pt")
    failed_at: Optional[float] = None  # when fn raised: before the group closes and the peers fail in turn
    try:
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            result = fn(rank, world_size, *args)
        except BaseException:
            failed_at = time.time()
            raise
        finally:
            dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - hand the traceback to the launcher, then fail the process
        torch.save({"ok": False, "error": traceback.format_exc(), "time": failed_at or time.time()}, path)
        raise SystemExit(1)


def launch_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    backend: Optional[str] = None,
    timeout: float = 300.0,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with a process group.

    Like ``torchrun``: ``spawn``ed processes whose environment holds ``MASTER_ADDR``,
    ``MASTER_PORT`` (a free port), ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; the default
    process group is initialised before ``fn`` runs (``gloo`` on CPU, ``nccl`` on CUDA with
    ``cuda:rank`` as the current device) and destroyed after. ``fn`` must be importable
    (module level) and its result picklable by ``torch.save``.

    Returns:
        ``fn``'s result of every rank, in rank order.

    Raises:
        ValueError: ``world_size < 1``, or more CUDA ranks than visible GPUs.
        RuntimeError: a rank failed (its traceback is in the message; the other ranks are
            terminated) or ``timeout`` seconds passed (all ranks are terminated).
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, but got {world_size}")
    if torch.device(device).type == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(f"{world_size} CUDA ranks need {world_size} GPUs, but {torch.cuda.device_count()} are visible; "
                         f"use --device cpu or fewer processes")
    backend = backend or default_backend(device)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="convbn-ddp-") as out_dir:
        port = find_free_port()
        procs = [ctx.Process(target=_worker_main, daemon=True,
                             args=(fn, rank, world_size, port, backend, device, out_dir, args, timeout))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        failed = _wait(procs, timeout)
        return _results(procs, out_dir, failed, timeout)


def _wait(procs: Sequence[Any], timeout: float) -> Optional[int]:
    """Wait for every worker, or until one fails or ``timeout`` passes; stop the ones left.
    Returns the rank of a worker that exited with an error, if any."""
    failed: Optional[int] = None
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        failed = next((r for r, p in enumerate(procs) if p.exitcode not in (None, 0)), failed)
    finally:
        _stop(procs)
    return failed


def _results(procs: Sequence[Any], out_dir: str, failed: Optional[int], timeout: float) -> List[Any]:
    """Every rank's result, read from ``out_dir``; the first failure's traceback raised where a rank failed."""
    world_size = len(procs)
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    errors = {r: p for r, p in enumerate(results) if p is not None and not p["ok"]}
    if errors:  # the rank that raised first is the cause; the others usually lost their peer then
        first = min(errors, key=lambda r: errors[r]["time"])
        others = "".join(f"\nrank {r} failed too: {p['error'].strip().splitlines()[-1]}"
                         for r, p in errors.items() if r != first)
        raise RuntimeError(f"distributed worker rank {first} of {world_size} failed:\n"
                           f"{errors[first]['error']}{others}")
    if failed is not None or any(r is None for r in results):
        missing = [r for r, p in enumerate(results) if p is None]
        why = f"rank {failed} exited with code {procs[failed].exitcode}" if failed is not None else \
            f"timed out after {timeout:.0f} s"
        raise RuntimeError(f"distributed workers did not finish ({why}); ranks without a result: {missing}")
    return [p["result"] for p in results]


def _stop(procs: Sequence[Any]) -> None:
    """Terminate (then kill) the launcher's own worker processes that are still running."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a job started by ``torchrun`` (or already in a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
