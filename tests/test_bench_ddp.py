"""``convbn bench --ddp N``: the data-parallel SyncBatchNorm benchmark and its process launcher.

Two gloo processes on CPU train the tutorial MNIST network (tiny batch, 2 steps); the table
must be printed with one row per configuration, the fused model's gradients must equal the
unfused synchronised reference, and the ranks must agree.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace
from typing import Any, List

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

from convbn.bench import ddp  # noqa: E402 - needs torch.distributed
from convbn.bench.ddp import DDP_CONFIGS, DDPRow, add_ddp_arguments, main_ddp  # noqa: E402
from convbn.bench.launch import launch_workers  # noqa: E402


def _parse(argv: List[str]) -> argparse.Namespace:
    return add_ddp_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_main_ddp_two_processes_mnist_prints_table(capsys: Any, monkeypatch: Any, tmp_path: Any) -> None:
    returned: List[DDPRow] = []
    run = ddp.run_ddp_bench

    def spy(*args: Any, **kwargs: Any) -> List[DDPRow]:
        rows = run(*args, **kwargs)
        returned.extend(rows)
        return rows

    monkeypatch.setattr(ddp, "run_ddp_bench", spy)
    js = tmp_path / "ddp.json"
    args = _parse(["--ddp", "2", "--model", "mnist", "--batch-size", "4", "--steps", "2", "--warmup", "0",
                   "--json", str(js), "--markdown"])
    assert main_ddp(args) == 0
    import json

    assert [r["config"] for r in json.loads(js.read_text())] == list(DDP_CONFIGS)

    out = capsys.readouterr().out
    assert "DDP training step" in out and "2 x cpu (gloo)" in out
    for name in ("eager", "SyncBatchNorm (unfused)", "convert auto", "saved ratio", "time ratio"):
        assert name in out, name
    assert "| mnist | convert auto |" in out  # --markdown without PATH: stdout

    assert [r.config for r in returned] == list(DDP_CONFIGS)
    eager, unfused, fused = returned
    for row in returned:
        assert row.model == "mnist" and row.world_size == 2 and row.input_shape == (4, 1, 28, 28)
        assert len(row.per_rank_saved) == len(row.per_rank_ms) == 2
        assert row.saved_bytes is not None and row.saved_bytes > 0
        assert row.median_ms is not None and row.median_ms > 0
        assert row.rank_param_diff == 0.0  # DDP keeps parameters identical
    assert eager.saved_ratio == eager.time_ratio == 1.0
    assert "local stats" in eager.note  # CPU: nn.SyncBatchNorm cannot run, the baseline says so
    assert unfused.rank_buffer_diff == fused.rank_buffer_diff == 0.0  # synchronised running stats agree
    assert fused.max_grad_diff is not None and fused.max_grad_diff < 1e-5
    assert fused.saved_bytes < eager.saved_bytes and fused.saved_ratio < 1.0
    assert "2 pairs fused" in fused.note


def test_main_ddp_bad_options_exit_2_without_launching(capsys: Any) -> None:
    for bad in (["--ddp", "0"], ["--ddp", "2", "--device", "meta"]):  # rejected while parsing
        with pytest.raises(SystemExit) as err:
            _parse(bad)
        assert err.value.code == 2
    assert "must be a positive integer, but got 0" in capsys.readouterr().err
    assert main_ddp(_parse(["--ddp", "2", "--model", "nosuch:bad-name"])) == 2
    assert "unknown model source" in capsys.readouterr().err


def test_add_ddp_arguments_shares_options_with_the_training_bench() -> None:
    from convbn.bench.training import add_training_arguments

    parser = add_ddp_arguments(add_training_arguments(argparse.ArgumentParser()))
    args = parser.parse_args(["--ddp", "2", "--model", "mnist", "--batch-size", "8"])
    assert args.ddp == 2 and args.model == ["mnist"] and args.batch_size == 8
    assert _parse([]).ddp is None


def _failing_worker(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()  # rank 0 would wait here for ever: the launcher must stop it
    return rank


def _echo_worker(rank: int, world: int, t: torch.Tensor) -> torch.Tensor:
    t = t * (rank + 1)
    dist.all_reduce(t)
    return t


class _StoppedClock:
    """``time.monotonic`` for the launcher that never reaches its deadline: the launcher returns
    because the ranks ended, never because time ran out. Past ``polls`` readings (the launcher
    polls every 0.05 s: over an hour) it fails the test instead of waiting for ever."""

    def __init__(self, polls: int = 100_000) -> None:
        self.left = polls

    def __call__(self) -> float:
        self.left -= 1
        if self.left < 0:
            raise AssertionError("the launcher kept waiting for rank 0 after rank 1 failed")
        return 0.0


def test_launch_workers_results_in_rank_order_and_failures_stop_every_rank(monkeypatch) -> None:
    results = launch_workers(_echo_worker, 2, torch.ones(3), timeout=600)
    assert [r.tolist() for r in results] == [[3.0] * 3] * 2

    import convbn.bench.launch as launch

    # not the timeout, on any machine: with a clock that never reaches the deadline the call ends
    # only once rank 1 has failed and rank 0 is stopped (by the launcher, or by its barrier losing
    # its peer), and says which rank failed and why; no elapsed time is compared
    monkeypatch.setattr(launch, "time", SimpleNamespace(monotonic=_StoppedClock(), sleep=time.sleep))
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed(.|\n)*rank 1 broke on purpose"):
        launch_workers(_failing_worker, 2, timeout=60)


def test_launch_workers_rejects_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        launch_workers(_echo_worker, 0)
