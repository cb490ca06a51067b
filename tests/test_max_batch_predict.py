"""max_batch predicts its answer from small steps (Note: [predicting the batch]) and checks
every argument before the first step.

The reference is the measuring search (``method="measure"``): a real step, of a model
converted for that batch, at every batch it tries; the prediction must give the same batches
and the peaks that search measured at them.
"""
import copy

import pytest
import torch
import torch.nn as nn

import convbn
import convbn.batch_search as batch_search
from convbn.largest_batch import _batch_of
from convbn.batch_predict import StepLines, largest_fitting
from convbn.memory import timeline
from convbn.passes.plan.plan_inputs import measure_plan_inputs, plan_inputs_at


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


def _resnet(width=8):
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         _Block(width), _Block(width), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def _warm(net, opt, x):
    m, o = copy.deepcopy((net, opt))
    timeline(m, *_batch_of(x, 2), optimizer=o)
    return m, o


@pytest.mark.parametrize("optim,memory,kwargs", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "2MiB", {}),
    (lambda p: torch.optim.Adam(p), "3MiB", {"chain": False}),
])
def test_predicted_max_batch_equals_the_measured_search(optim, memory, kwargs):
    torch.manual_seed(0)
    net = _resnet()
    opt = optim(net.parameters())
    x = torch.randn(2, 3, 16, 16)
    fast = convbn.max_batch(net, x, memory, optimizer=opt, confirm=False, **kwargs)
    slow = convbn.max_batch(net, x, memory, optimizer=opt, method="measure", **kwargs)
    assert fast.eager_batch == slow.eager_batch > 6 and fast.convbn_batch == slow.convbn_batch > fast.eager_batch
    # predicted, not measured there: the peaks are the ones the measuring search found at those batches
    assert fast.how["eager"].startswith("predicted") and fast.how["convbn"].startswith("predicted")
    assert fast.eager_batch not in fast.probes["eager"] and fast.convbn_batch not in fast.probes["convbn"]
    assert fast.eager_peak == slow.eager_peak == slow.probes["eager"][slow.eager_batch]
    # the converted side's predicted peak counts each chain's largest backward scratch at its
    # chain's highest moment (Note: [the kernels' scratch in the convbn prediction]): a bound
    assert slow.convbn_peak <= fast.convbn_peak <= slow.convbn_peak + 64 * 1024
    assert slow.convbn_peak == slow.probes["convbn"][slow.convbn_batch]
    above = slow.convbn_batch + 1  # the resident bytes, its inputs and its step are over
    assert slow.resident + above * slow.sample_bytes + slow.probes["convbn"][above] > slow.memory


def test_confirmed_prediction_measures_the_answer_and_the_batch_above():
    torch.manual_seed(0)
    net = _resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    fit = convbn.max_batch(net, torch.randn(2, 3, 16, 16), "2MiB", optimizer=opt, confirm=True)
    for side, batch, peak in (("eager", fit.eager_batch, fit.eager_peak), ("convbn", fit.convbn_batch, fit.convbn_peak)):
        assert fit.how[side].startswith(f"measured at batch {batch}") and "predicted alike" in fit.how[side]
        assert fit.probes[side][batch] == peak and fit.resident + batch * fit.sample_bytes + peak <= fit.memory
        assert fit.resident + (batch + 1) * fit.sample_bytes + fit.probes[side][batch + 1] > fit.memory
    assert fit.how["eager"] in str(fit)


def test_the_planners_inputs_are_lines_in_the_batch():
    torch.manual_seed(0)
    net = _resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = (torch.randn(2, 3, 16, 16),)
    m, o = _warm(net, opt, x)
    conv = convbn.convert(m, example_inputs=_batch_of(x, 2))
    measured = {b: measure_plan_inputs(conv, _batch_of(x, b), optimizer=o)[1] for b in (2, 4, 11)}
    predicted = plan_inputs_at(measured[2], measured[4], 11)
    assert predicted == measured[11]
    assert predicted.costs() == measured[11].costs() and predicted.gaps() == measured[11].gaps()
    assert len(predicted.costs()) == 3  # the stem's chain and one per block
    with pytest.raises(ValueError, match="two different batches"):
        plan_inputs_at(measured[2], measured[2], 8)


def test_step_lines_predict_every_point_of_the_eager_step():
    torch.manual_seed(0)
    net = _resnet()
    opt = torch.optim.Adam(net.parameters())
    x = (torch.randn(2, 3, 16, 16),)
    m, o = _warm(net, opt, x)
    tl = {b: timeline(copy.deepcopy(m), *_batch_of(x, b), optimizer=copy.deepcopy(o)) for b in (2, 4, 13)}
    lines = StepLines(tl[2], 2, tl[4], 4)
    assert lines.agrees(tl[13], 13) and lines.peak_at(13) == tl[13].peak
    assert not lines.agrees(tl[4], 5)


def test_largest_fitting():
    for answer in (0, 1, 2, 37, 64, 100):
        assert largest_fitting(lambda b: b <= answer, 100) == answer
    assert largest_fitting(lambda b: True, 1000) == 1000


def test_a_step_off_the_line_is_measured_instead(monkeypatch):
    torch.manual_seed(0)
    net = _resnet()
    x = torch.randn(2, 3, 16, 16)
    monkeypatch.setattr(StepLines, "agrees", lambda self, tl, b: False)
    fit = convbn.max_batch(net, x, "1MiB", confirm=False)
    ref = convbn.max_batch(net, x, "1MiB", method="measure")
    assert fit.how["eager"].startswith("measured") and "off the line" in fit.how["eager"]
    assert fit.eager_batch == ref.eager_batch and fit.eager_peak == ref.eager_peak


# ---------------------------------------------------------------------------- arguments before work


BAD = [
    (dict(memory="12XB"), ValueError, "memory must be a number and a unit"),
    (dict(memory=-5), ValueError, "memory must be positive"),
    (dict(loss_fn="mse"), TypeError, "loss_fn must be callable"),
    (dict(method="fast"), ValueError, "method must be 'predict' or 'measure'"),
    (dict(confirm="yes"), TypeError, "confirm must be 'auto', True or False"),
    (dict(progress="loud"), TypeError, "progress must be None"),
    (dict(chian=False), TypeError, "convbn.convert, which says"),
    (dict(strategy="recompute_bn"), ValueError, "strategy='auto' only"),
    (dict(peak_budget=0.5), ValueError, "memory_limit .*or peak_budget"),
    (dict(memory_limit="1GiB"), TypeError, "max_batch sets memory_limit"),
    (dict(example_inputs=[1, 2]), TypeError, "example_inputs must be a tensor"),
]


@pytest.mark.parametrize("bad,error,match", BAD, ids=[next(iter(b)) + "=" + repr(next(iter(b.values()))) for b, _, _ in BAD])
def test_max_batch_checks_every_argument_before_any_step(monkeypatch, bad, error, match):
    def no_step(*args, **kwargs):
        raise AssertionError("a step ran before the arguments were checked")

    monkeypatch.setattr(batch_search, "timeline", no_step)
    monkeypatch.setattr(batch_search.copy, "deepcopy", no_step)
    net = _resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    args = dict(example_inputs=torch.randn(2, 3, 16, 16), memory="64MiB", optimizer=opt)
    args.update(bad)
    example, memory = args.pop("example_inputs"), args.pop("memory")
    with pytest.raises(error, match=match):
        convbn.max_batch(net, example, memory, **args)


def test_a_refuted_prediction_is_walked_to_the_measured_answer(monkeypatch):
    """A prediction the confirming steps refute (here made one batch low on purpose) is walked,
    a real step at a time, to the answer the measuring search finds (Note: [the kernels' scratch
    in the convbn prediction]); fails with the walk removed (the side is then measured, and
    ``how`` says so)."""
    torch.manual_seed(0)
    net = _resnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 3, 16, 16)
    slow = convbn.max_batch(net, x, "2MiB", optimizer=opt, method="measure")
    real = batch_search.largest_fitting
    monkeypatch.setattr(batch_search, "largest_fitting", lambda fits, upper: real(fits, upper) - 1)
    fit = convbn.max_batch(net, x, "2MiB", optimizer=opt, confirm=True)
    for side, batch in (("eager", fit.eager_batch), ("convbn", fit.convbn_batch)):
        assert batch == getattr(slow, f"{side}_batch")
        assert fit.how[side] == f"measured at batch {batch} and the batch above it (predicted {batch - 1})"
        assert fit.probes[side][batch] == slow.probes[side][batch] and batch + 1 in fit.probes[side]
