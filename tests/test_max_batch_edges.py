"""max_batch's answer depends on no clock, answering stays within the memory asked about,
and nonsense at the edges is refused by name with the model unchanged.

Notes [answering within the limit] and [confirming by counted work] in ``batch_search.py``.
"""
import gc
import math
import time
import weakref

import pytest
import torch
import torch.nn as nn

import convbn
import convbn.batch_search as batch_search
import convbn.passes.plan.plan_inputs as plan_inputs
from convbn.batch_predict import step_flops
from convbn.largest_batch import BatchFit
from convbn.memory import timeline
from convbn.memory.timelines import StepOverLimit

from test_max_batch_predict import _resnet


def _setup():
    torch.manual_seed(0)
    net = _resnet()
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), torch.randn(2, 3, 16, 16)


def _state(net, opt):
    return ({k: v.clone() for k, v in net.state_dict().items()}, [p.grad for p in net.parameters()],
            net.training, len(opt.state))


def _same_state(a, b):
    (sa, ga, ta, oa), (sb, gb, tb, ob) = a, b
    return (sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
            and all(x is y for x, y in zip(ga, gb)) and ta == tb and oa == ob)


class _FakeClock:
    """Every reading ``step`` seconds after the one before."""

    def __init__(self, step):
        self.now, self.step = 1000.0, step

    def __call__(self):
        self.now += self.step
        return self.now


def test_the_same_answer_on_a_fast_and_on_a_busy_clock(monkeypatch):
    net, opt, x = _setup()
    fits = []
    for step in (1e-9, 1e4):  # a very fast machine, then one where every step seems to take hours
        clock = _FakeClock(step)
        for name in ("perf_counter", "monotonic", "time", "process_time"):
            monkeypatch.setattr(time, name, clock)
        fits.append(convbn.max_batch(net, x, "2MiB", optimizer=opt))  # confirm="auto", the default
        monkeypatch.undo()
    fast, busy = fits
    assert str(fast) == str(busy) and fast.probes == busy.probes and fast.how == busy.how
    # the default confirms this small model (a few MFLOP): the answer and the batch above were stepped
    assert "predicted alike" in fast.how["eager"] and "predicted alike" in fast.how["convbn"]
    assert fast.eager_batch + 1 in fast.probes["eager"] and fast.convbn_batch + 1 in fast.probes["convbn"]


def test_auto_confirms_by_the_counted_work_of_the_confirming_steps(monkeypatch):
    net, opt, x = _setup()
    flops = step_flops(_resnet(), (torch.randn(2, 3, 16, 16),))
    confirmed = convbn.max_batch(net, x, "2MiB", optimizer=opt)
    b = confirmed.eager_batch
    # just below what the eager side's confirming steps (batches b and b + 1) count: not confirmed
    monkeypatch.setattr(batch_search, "CONFIRM_FLOPS", flops / 2 * (2 * b + 1) - 1)
    skipped = convbn.max_batch(net, x, "2MiB", optimizer=opt)
    assert "not confirmed" in skipped.how["eager"] and "confirm='auto'" in skipped.how["eager"]
    assert b not in skipped.probes["eager"] and b + 1 not in skipped.probes["eager"]
    assert (skipped.eager_batch, skipped.eager_peak) == (b, confirmed.eager_peak)  # the same answer, unconfirmed
    monkeypatch.setattr(batch_search, "CONFIRM_FLOPS", flops / 2 * (2 * b + 1))
    assert "predicted alike" in convbn.max_batch(net, x, "2MiB", optimizer=opt).how["eager"]


def test_step_flops_counts_forward_and_backward():
    lin = nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8, requires_grad=True)
    assert step_flops(lin, (x,)) == 3 * (2 * 3 * 8 * 4)  # forward, input gradient, weight gradient
    assert lin.weight.grad is None


def test_a_step_over_the_limit_is_stopped_by_timeline():
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    x = torch.randn(4, 3, 16, 16)
    full = timeline(net, x)
    with pytest.raises(StepOverLimit) as err:
        timeline(net, x, stop_above=full.peak - 1)
    stop, peak = err.value.point, full.peak_point
    assert err.value.bytes == full.peak and (stop.phase, stop.module, stop.op) == (peak.phase, peak.module, peak.op)
    assert timeline(net, x, stop_above=full.peak).peak == full.peak
    with pytest.raises(TypeError, match="stop_above must be None or an int"):
        timeline(net, x, stop_above=1.5)


@pytest.mark.parametrize("confirm", [True, False])
def test_answering_stays_within_the_limit_and_holds_one_copy(monkeypatch, confirm):
    """Every step max_batch runs ends within the limit or is stopped at the first operator
    over it, and a copy of the model exists only once the one before it is gone."""
    net, opt, x = _setup()
    steps, copies = [], []
    real_timeline, real_deepcopy = batch_search.timeline, batch_search.copy.deepcopy

    def recording_timeline(*args, **kwargs):
        try:
            tl = real_timeline(*args, **kwargs)
        except StepOverLimit as over:
            steps.append(("stopped", over.bytes, kwargs["stop_above"]))
            raise
        steps.append(("ended", tl.peak, kwargs.get("stop_above")))
        return tl

    class Copier:
        @staticmethod
        def deepcopy(obj, *args):
            gc.collect()
            assert all(ref() is None for ref in copies), "a second copy of the model while one was alive"
            out = real_deepcopy(obj, *args)
            copies.append(weakref.ref(out[0]))
            return out

    monkeypatch.setattr(batch_search, "timeline", recording_timeline)
    monkeypatch.setattr(plan_inputs, "timeline", recording_timeline)
    monkeypatch.setattr(batch_search, "copy", Copier)
    fit = convbn.max_batch(net, x, "2MiB", optimizer=opt, confirm=confirm)
    rooms = {fit.usable - fit.resident - b * fit.sample_bytes for side in fit.probes.values() for b in side}
    probe_steps = [s for s in steps if s[2] is not None]  # plan measurement's own recordings have no limit
    assert probe_steps and all(limit in rooms for _, _, limit in probe_steps)  # the room its batch left
    assert all(peak <= room for kind, peak, room in probe_steps if kind == "ended")
    stopped = [s for s in probe_steps if s[0] == "stopped"]
    assert len(stopped) == (2 if confirm else 0)  # the batch above each answer
    assert all(peak > room for _, peak, room in stopped)
    assert len(copies) == 2  # one per side


MEMORY = [
    (10, ValueError, "memory=10 .* is below what one sample needs: the model's parameters and buffers alone"),
    (float("nan"), ValueError, "memory must be a finite number of bytes, but got nan"),
    (math.inf, ValueError, "memory must be a finite number of bytes, but got inf"),
    (0, ValueError, r"memory must be positive \(at least one byte\), but got 0"),
    (-1, ValueError, "memory must be positive .*but got -1"),
    (0.5, ValueError, "memory must be positive .*but got 0.5"),
    ("-5MiB", ValueError, "memory must be a number and a unit .*but got '-5MiB'"),
    ("nan", ValueError, "memory must be a number and a unit .*but got 'nan'"),
    ("", ValueError, "memory must be a number and a unit .*but got ''"),
    ([1], TypeError, "memory must be a number of bytes or a string .*but got list"),
]


@pytest.mark.parametrize("memory,error,match", MEMORY, ids=[repr(m) for m, _, _ in MEMORY])
def test_nonsense_memory_is_refused_by_name_with_the_model_unchanged(memory, error, match):
    net, opt, x = _setup()
    before = _state(net, opt)
    with pytest.raises(error, match=match):
        convbn.max_batch(net, x, memory, optimizer=opt)
    assert _same_state(before, _state(net, opt))


def test_a_limit_below_one_sample_is_a_value_error_not_batch_zero():
    net, opt, x = _setup()
    before = _state(net, opt)
    resident = 2 * sum(p.numel() * 4 for p in net.parameters()) + sum(b.nbytes for b in net.buffers())
    with pytest.raises(ValueError, match="parameters, buffers and optimizer state alone"):
        convbn.max_batch(net, x, resident - 8, optimizer=opt)  # room for the model, not its momentum
    with pytest.raises(ValueError, match="below what one sample needs: resident .* even converted"):
        convbn.max_batch(net, x, resident + 4096, optimizer=opt)  # the state fits, no step does
    assert _same_state(before, _state(net, opt))


def test_an_optimizer_over_another_models_parameters_is_refused():
    net, opt, x = _setup()
    other = torch.optim.SGD(_resnet().parameters(), lr=0.1)
    before = _state(net, opt)
    with pytest.raises(ValueError, match=r"optimizer must be over model's parameters, but \d+ of its \d+ "
                                         r"parameters .* are not parameters of the Sequential given"):
        convbn.max_batch(net, x, "2MiB", optimizer=other)
    assert _same_state(before, _state(net, opt)) and not other.state
    part = torch.optim.SGD(list(net.parameters())[:3], lr=0.1)  # a subset (a frozen backbone): fine
    assert convbn.max_batch(net, x, "2MiB", optimizer=part, confirm=False).eager_batch > 0


def test_a_summary_without_an_eager_batch_says_so():
    fit = BatchFit(memory=2 << 20, usable=2 << 20, resident=0, eager_batch=0, convbn_batch=3)
    assert fit.summary() == "in 2.0 MiB: eager trains no batch (not one sample), convbn batch 3"
    assert "inf" not in str(fit)


def test_the_command_line_says_a_too_small_memory_in_one_line(tmp_path, monkeypatch, capsys):
    from convbn.cli import main

    (tmp_path / "edge_nets.py").write_text(
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),\n"
        "                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))\n")
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "edge_nets:build", "--input-shape", "2x3x12x12", "--memory", "10", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("convbn explain: error: memory='10' (10 B) is below what one sample needs")
    assert "Traceback" not in err[0] and "batch 0" not in err[0]
