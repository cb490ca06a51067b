"""The demo's side-by-side training (:func:`convbn.demo.run_demo`): every step feeds the same
minibatch and the same dropout masks (the RNG state is replayed) to each network in turn,
records its loss and time (its exact peak on the measured step), and notes the first step
whose gradients differ from the unfused network's; each epoch ends with the test accuracy."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convbn.bench.table import require_rich
from convbn.demo_results import CONFIGS, DemoResult
from convbn.memory import timeline

__all__ = ["DemoRun", "StepStats", "train", "grad_difference"]


def _rng_state(device: torch.device) -> Tuple[Tensor, Optional[Tensor]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: Tuple[Tensor, Optional[Tensor]], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass
class StepStats:
    """One training step: loss, seconds, and its exact peak (bytes above the start) when measured."""

    loss: float
    seconds: float
    peak: Optional[int] = None


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, device: torch.device, measure_peak: bool
) -> StepStats:
    """Forward, NLL loss, backward, optimizer step. A timed step runs bare; a ``measure_peak``
    step is recorded by :func:`convbn.memory.timeline`, convbn's one definition of a step's
    peak (exact live tensor bytes on CPU, the CUDA allocator on a GPU; slower, so not timed)."""
    cuda = device.type == "cuda"
    if measure_peak:
        t0 = time.perf_counter()
        tl = timeline(model, x, loss_fn=lambda out: F.nll_loss(out, y), optimizer=opt)
        return StepStats(float(tl.loss or 0.0), time.perf_counter() - t0, int(tl.peak))
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = F.nll_loss(model(x), y)
    loss.backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    return StepStats(float(loss.detach()), seconds, None)


@torch.no_grad()
def _accuracy(model: nn.Module, x: Tensor, y: Tensor, batch: int) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(y), batch):
        correct += int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum())
    model.train()
    return correct / max(len(y), 1)


@dataclass
class DemoRun:
    """The demo's data, networks and optimizers, and what training records."""

    device: torch.device
    source: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    batch: int
    steps: int  # per epoch
    peak_step: int  # the step measured for its exact peak
    result: DemoResult
    models: Dict[str, nn.Module]
    opts: Dict[str, torch.optim.Optimizer]
    scheds: Dict[str, Any]
    stats: Dict[str, List[StepStats]]
    first_grad_diff: Dict[str, Tuple[int, float]]  # first step whose gradients differ from unfused's


def train(run: DemoRun, epochs: int, seed: int, console: Any, progress_bar: bool) -> None:
    """Train the three networks side by side, epoch by epoch, with a progress bar where asked."""
    result = run.result
    shuffle = torch.Generator().manual_seed(seed)
    progress = _progress(console) if (console is not None and progress_bar) else None
    task = progress.add_task("training", total=epochs * run.steps) if progress is not None else None
    if progress is not None:
        progress.start()
    try:
        step_no = 0
        for epoch in range(1, epochs + 1):
            perm = torch.randperm(len(run.train_y), generator=shuffle).to(run.device)
            for step in range(run.steps):
                _train_all(run, perm[step * run.batch : (step + 1) * run.batch], step_no)
                step_no += 1
                if progress is not None:
                    progress.update(task, advance=1, description=f"epoch {epoch} loss {result.step_losses['unfused'][-1]:.4f}")
            for s in run.scheds.values():
                s.step()
            for name, model in run.models.items():
                result.accuracy[name].append(_accuracy(model, run.test_x, run.test_y, run.batch))
            if console is not None:
                accs = ", ".join(f"{k} {100 * result.accuracy[k][-1]:.1f}%" for k in CONFIGS)
                console.print(f"epoch {epoch}: last train loss {result.step_losses['unfused'][-1]:.4f}; test accuracy {accs}")
    finally:
        if progress is not None:
            progress.stop()


def _train_all(run: DemoRun, idx: Tensor, step_no: int) -> None:
    """One step of every network on the minibatch ``idx``, with the same dropout masks."""
    x, y = run.train_x[idx], run.train_y[idx]
    state = _rng_state(run.device)
    for name, model in run.models.items():
        _set_rng_state(state, run.device)  # same dropout masks for all
        st = _train_step(model, run.opts[name], x, y, run.device, measure_peak=step_no == run.peak_step)
        run.stats[name].append(st)
        run.result.step_losses[name].append(st.loss)
    for name in CONFIGS[1:]:  # the gradients of this step are still in .grad (untimed)
        if name not in run.first_grad_diff:
            gdiff = grad_difference(run.models[name], run.models["unfused"])
            if gdiff != 0.0:
                run.first_grad_diff[name] = (step_no, gdiff)


def grad_difference(model: nn.Module, reference: nn.Module) -> float:
    """Largest absolute difference between the ``.grad`` of same-named parameters (0.0: bit-identical)."""
    ref = dict(reference.named_parameters())
    diff = 0.0
    for name, p in model.named_parameters():
        g, r = p.grad, ref[name].grad
        if g is not None and r is not None:
            diff = max(diff, (g - r).abs().max().item())
    return diff


def _progress(console: Any) -> Any:
    require_rich("the demo's progress bar")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )
