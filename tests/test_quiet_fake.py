"""A fake run that fails inside convert's own shape trace writes nothing to the user's log
(Note: [a fake run that fails is not the user's error]); torch's records outside it still do."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
from torch import nn

import convbn
from convbn._compat import FAKE_TENSOR_LOGGER, FakeTensorMode
from convbn.passes.graph.quiet_fake import fake_errors_quiet
from fusion_checks import assert_fused


class CacheByShape(nn.Module):
    """A branch on the input's shape (traced with real inputs), then a concatenation only the
    trace cannot compute (eager raises and catches it), then Conv -> GroupNorm -> ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.gn = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)

    def forward(self, x):
        y = torch.relu(self.gn(self.conv(x)))
        if x.shape[0] > 1:
            try:
                torch.cat([y, y[:1].new_zeros(1, 2, 3)])
            except RuntimeError:
                pass
        return y * 2


def _fake_records(caplog: pytest.LogCaptureFixture) -> list:
    """What the fake mode wrote at WARNING or above (its DEBUG lines of mode creation aside)."""
    return [r for r in caplog.records if r.name == FAKE_TENSOR_LOGGER and r.levelno >= logging.WARNING]


def test_convert_logs_no_failed_fake_run(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, x = CacheByShape(), torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.DEBUG, logger=FAKE_TENSOR_LOGGER):
        converted = convbn.convert(model, example_inputs=x)
    assert _fake_records(caplog) == []
    assert_fused(converted, pairs=1)


def _failing_fake_cat() -> None:
    with FakeTensorMode() as mode:
        a = mode.from_tensor(torch.zeros(2, 3))
        with pytest.raises(RuntimeError):
            torch.cat([a, mode.from_tensor(torch.zeros(2))])


def test_the_log_outside_the_capture_and_on_other_threads_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=FAKE_TENSOR_LOGGER):
        _failing_fake_cat()
        outside = len(_fake_records(caplog))
        with fake_errors_quiet():
            _failing_fake_cat()
            inside = len(_fake_records(caplog)) - outside
            other = threading.Thread(target=_failing_fake_cat)
            other.start()
            other.join()
            on_other_thread = len(_fake_records(caplog)) - outside - inside
    assert outside >= 1 and inside == 0 and on_other_thread >= 1
