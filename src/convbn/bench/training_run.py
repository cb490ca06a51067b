"""One run of the training benchmark (:func:`convbn.bench.training.run_training_bench`): every
configuration built from copies of one model and stepped on one input, then measured in
round-robin rounds (see the Notes in :mod:`convbn.bench.training`: [Round-robin timing],
[Saved bytes under torch.compile])."""
from __future__ import annotations

import copy
import ctypes
import gc
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd

from convbn.bench.common import first_tensor, progress_bar, projection_loss, short_error, timed_ms
from convbn.bench.concat_checkpoint import NoConcatHead
from convbn.bench.models import build_model, check_input
from convbn.bench.training_configs import TrainingConfig, build_config, config_names
from convbn.bench.training_output import TrainingRow, write_plot
from convbn.bench.training_settings import TrainingBenchSettings
from convbn.memory import peak_memory, timeline, track_saved
from convbn.progress import progress_scope

__all__ = ["TrainingRun"]


def _step(cfg: TrainingConfig, x: Tensor, proj: Tensor) -> Tensor:
    cfg.optimizer.zero_grad(set_to_none=True)
    with cfg.context():
        out = first_tensor(cfg.model(x))
        projection_loss(out, proj).backward()
    cfg.optimizer.step()
    return out.detach()


_LIBC: Any = None


def _release_freed_memory(device: torch.device) -> None:
    """Give freed heap pages back to the OS so RSS-based peaks start from a comparable floor."""
    global _LIBC
    gc.collect()
    if device.type == "cuda":
        return
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:  # pragma: no cover - not glibc
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def _max_diff(a: Optional[Tensor], b: Optional[Tensor]) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _max_abs(t: Optional[Tensor]) -> float:
    return 0.0 if t is None or not t.numel() else t.abs().max().item()


def _saved_bytes(cfg: TrainingConfig, x: Tensor) -> Tuple[int, int]:
    """``(saved bytes, saved bytes without parameters)`` of one training forward.

    Note: [Activation bytes]
        :func:`convbn.memory.saved_bytes` counts a parameter when an op saves it (eager conv
        saves its weight), but convbn's fused layers hold weights by reference and checkpointed
        blocks save only their inputs, so at small inputs the totals mostly compare parameter
        bookkeeping. The second figure drops parameter storages. It still counts tensors derived
        from parameters: inductor on CPU saves channels-last copies of conv weights for backward
        (layout optimization), which are real extra memory held by ``torch.compile`` configurations.
    """
    with torch.enable_grad(), track_saved(cfg.model, per_module=False) as rec:
        out = cfg.model(x)
    del out
    return rec.result.total, rec.result.activation_bytes


# --------------------------------------------------------------------------- the benchmark


def _make_input(model: nn.Module, shape: Tuple[int, ...], batch_size: int, image_size: Optional[int],
                spec: str, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    if image_size is not None and len(shape) > 1:
        resized = (shape[0],) + (image_size,) * (len(shape) - 1)
        if resized != tuple(shape):
            modes = [(m, m.training) for m in model.modules()]
            try:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(1, *resized, generator=gen).to(device, dtype))
                shape = resized
            except Exception as exc:  # noqa: BLE001 - a fixed-size model (e.g. mnist) keeps its size
                warnings.warn(f"{spec}: --image-size {image_size} does not fit this model ({short_error(exc)}); "
                              f"keeping its input size {tuple(shape[1:])}", stacklevel=3)
            finally:
                for m, t in modes:
                    m.training = t
    x = torch.randn(batch_size, *shape, generator=gen).to(device, dtype)
    check_input(model, x, spec, "pass --image-size with a size the model takes")
    return x


class TrainingRun:
    """One run of the training benchmark: the model and input every configuration shares,
    and the rows as the phases of :meth:`run` fill them."""

    def __init__(self, settings: TrainingBenchSettings) -> None:
        s = self.settings = settings
        self.names = config_names(s.configs, s.budgets, s.compile_budgets, s.use_compile, s.peak_budgets)
        self.device = torch.device(s.device)
        if s.model is not None:
            if s.input_shape is None:
                raise ValueError("run_training_bench(model=...) needs input_shape=(C, H, W) (without the batch dimension)")
            base, shape = copy.deepcopy(s.model), tuple(s.input_shape)
        else:
            torch.manual_seed(s.seed)
            base, shape = build_model(s.spec)
        self.base = base.to(device=self.device, dtype=s.dtype).train()
        self.gen = torch.Generator().manual_seed(s.seed)
        self.x = _make_input(self.base, tuple(shape), s.batch_size, s.image_size, s.spec, self.device, s.dtype,
                             self.gen)
        dtype_name = str(s.dtype).replace("torch.", "")
        self.rows: Dict[str, TrainingRow] = {n: TrainingRow(s.spec, n, tuple(self.x.shape), str(self.device),
                                                            dtype_name) for n in self.names}
        self.cfgs: List[TrainingConfig] = []
        self.proj: Optional[Tensor] = None  # the loss's projection, drawn once eager's output shape is known
        self.eager: Optional[Tuple[Tensor, List[Optional[Tensor]], List[Tensor]]] = None  # first step's out, grads, buffers
        self.peaks: Dict[str, List[int]] = {}
        self.times: Dict[str, List[float]] = {}

    def run(self) -> List[TrainingRow]:
        """Build + first step, saved bytes, warm-up, peak and timed rounds; then the ratios."""
        s, x = self.settings, self.x
        with progress_scope("bench", False), progress_bar(s.progress) as bar:  # the bar, not convert's lines
            self.bar, self.task = bar, bar.add_task(f"{s.spec}: building", total=len(self.names) * s.rounds_per_config)
            for name in list(self.names):  # same weights, input and seed -> differences from eager
                self._build(name)
            for cfg in self.cfgs:
                self._saved(cfg)
            assert self.proj is not None  # eager ran
            self._rounds(s.warmup, "warm-up", lambda cfg, r: _step(cfg, x, self.proj))
            self.peaks = {c.name: [] for c in self.cfgs}
            self._rounds(s.memory_rounds, "peak memory", self._measure_peak)
            self.times = {c.name: [] for c in self.cfgs}
            self._rounds(s.steps, "timed step",
                         lambda cfg, r: self.times[cfg.name].append(timed_ms(lambda: _step(cfg, x, self.proj), self.device)))
        return self._summary()

    def _note(self, name: str, text: str) -> None:
        row = self.rows[name]
        row.note += f"{'; ' if row.note else ''}{text}"

    def _build(self, name: str) -> None:
        """Build configuration ``name`` and run its first step; a failure is noted in its row."""
        s, row = self.settings, self.rows[name]
        self.bar.update(self.task, description=f"{s.spec}: {name}: build + first step")
        t0 = time.perf_counter()
        try:
            cfg = build_config(name, self.base, self.x, s.lr)
            if self.proj is None:
                with torch.no_grad():
                    probe = first_tensor(copy.deepcopy(self.base).eval()(self.x[:1]))
                self.proj = torch.randn(probe.shape[1:], generator=self.gen).to(self.device)
            torch.manual_seed(s.seed + 1)
            out = _step(cfg, self.x, self.proj)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - report the failure in the row, keep going
            if name == "eager":
                raise
            if isinstance(exc, NoConcatHead) and s.configs is None:
                del self.rows[name]  # not asked for by name: a model without concatenations has no such row
                self.names.remove(name)
            else:
                row.note = f"failed: {short_error(exc)}"
            self.bar.advance(self.task, s.rounds_per_config)
            return
        row.setup_s = time.perf_counter() - t0
        self._compare_to_eager(cfg, row, out)
        row.note = cfg.note
        self.cfgs.append(cfg)
        self.bar.advance(self.task)

    def _compare_to_eager(self, cfg: TrainingConfig, row: TrainingRow, out: Tensor) -> None:
        """Record the first step's differences from eager's (eager itself: keep them)."""
        # zero_grad(set_to_none) at the next step start; these grads are the first step's
        grads = [None if p.grad is None else p.grad.detach().clone() for p in cfg.params]
        buffers = [b.detach().clone() for b in cfg.buffers if b.is_floating_point()]
        if cfg.name == "eager":
            self.eager = (out.clone(), grads, buffers)
            return
        ref_out, ref_grads, ref_buffers = self.eager
        row.max_out_diff = _max_diff(out, ref_out)
        row.max_grad_diff = max((_max_diff(g, r) for g, r in zip(grads, ref_grads)), default=0.0)
        scale = max((_max_abs(r) for r in ref_grads), default=0.0)
        row.max_grad_rel_diff = row.max_grad_diff / scale if scale > 0 else None
        buf = max((_max_diff(b, r) for b, r in zip(buffers, ref_buffers)), default=0.0)
        if buf > 1e-4:
            cfg.note += f"{'; ' if cfg.note else ''}running stats differ from eager by {buf:.1e}"
        if (cfg.name.startswith("torch.compile") and
                any(isinstance(m, _DropoutNd) and m.p > 0 for m in self.base.modules())):
            cfg.note += f"{'; ' if cfg.note else ''}dropout RNG differs under compile"

    def _saved(self, cfg: TrainingConfig) -> None:
        """Saved bytes of one training forward (see Note: [Saved bytes under torch.compile])."""
        self.bar.update(self.task, description=f"{self.settings.spec}: {cfg.name}: saved bytes")
        try:
            with cfg.context():
                self.rows[cfg.name].saved_bytes, self.rows[cfg.name].activation_bytes = _saved_bytes(cfg, self.x)
        except Exception as exc:  # noqa: BLE001
            self._note(cfg.name, f"saved bytes failed: {short_error(exc)}")
        self.bar.advance(self.task)

    def _rounds(self, n: int, label: str, body: Callable[[TrainingConfig, int], None]) -> None:
        """``n`` rounds of ``body`` over every live configuration (see Note: [Round-robin timing])."""
        for r in range(n):
            self.bar.update(self.task, description=f"{self.settings.spec}: {label} {r + 1}/{n}")
            live = [c for c in self.cfgs if not c.failed]
            k = r % max(len(live), 1)
            for cfg in live[k:] + live[:k]:
                try:
                    body(cfg, r)
                except Exception as exc:  # noqa: BLE001
                    cfg.failed = True
                    self._note(cfg.name, f"failed in {label}: {short_error(exc)}")
                self.bar.advance(self.task)

    def _measure_peak(self, cfg: TrainingConfig, r: int) -> None:
        # Note: [peak on CPU] exact live-tensor bytes (timeline, the one definition) where possible;
        # compiled graphs run outside Python dispatch, so for them fall back to
        # sampled process RSS and say so in the row.
        device, x, proj = self.device, self.x, self.proj
        _release_freed_memory(device)
        if "torch.compile" not in cfg.name:
            with cfg.context():
                tl = timeline(cfg.model, x, loss_fn=lambda out: projection_loss(first_tensor(out), proj),
                              optimizer=cfg.optimizer)
            self.peaks[cfg.name].append(tl.peak)
            return
        if device.type == "cpu" and r == 0:
            self._note(cfg.name, "peak: sampled RSS")
        cfg.optimizer.zero_grad(set_to_none=True)  # as timeline: freed gradients are not the step's
        _release_freed_memory(device)
        with peak_memory(device) as meter:
            _step(cfg, x, proj)
        self.peaks[cfg.name].append(meter.result.peak)

    def _summary(self) -> List[TrainingRow]:
        """Medians and ratios to eager, in configuration order; the plot where asked."""
        rows = self.rows
        for cfg in self.cfgs:
            row = rows[cfg.name]
            if self.peaks[cfg.name] and not cfg.failed:
                row.peak_bytes = int(statistics.median(self.peaks[cfg.name]))
            if self.times[cfg.name] and not cfg.failed:
                row.median_ms = statistics.median(self.times[cfg.name])
        eager = rows["eager"]
        for row in rows.values():
            if row.saved_bytes is not None and eager.saved_bytes:
                row.saved_ratio = row.saved_bytes / eager.saved_bytes
            if row.activation_bytes is not None and eager.activation_bytes:
                row.activation_ratio = row.activation_bytes / eager.activation_bytes
            if row.peak_bytes is not None and eager.peak_bytes:
                row.peak_ratio = row.peak_bytes / eager.peak_bytes
            if row.median_ms is not None and eager.median_ms:
                row.time_ratio = row.median_ms / eager.median_ms
        result = [rows[n] for n in self.names]
        if self.settings.plot_path:
            write_plot(result, self.settings.plot_path)
        return result
