"""Shared test set-up.

One intra-op thread per test process: the suite runs with ``pytest -n 2`` on small
machines, where two workers each using every core slow tiny kernels down by orders of
magnitude (oversubscription).

Silence is a failure (issue 23): every test is watched by :mod:`fusion_watch`. A model
``convbn.convert`` returned must have fused something, and every ``FusedChain`` call that
autograd records must have gone through the fused Function; a test whose point is that
nothing is fused (or that a chain runs as eager modules) says so with
``@pytest.mark.expect_unfused("why")``.
"""
import pytest
import torch

import fusion_watch

fusion_watch.install()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "expect_unfused(reason): the test expects convbn.convert to fuse nothing, or chains to run as eager "
        "modules (hooks, zero-size inputs, ...); the fusion watch does not check it",
    )


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Watch the test body; after it passed, fail it if it converted a model that fused
    nothing or ran a chain unfused (:func:`fusion_watch.check`)."""
    marker = item.get_closest_marker("expect_unfused")
    if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0]):
        raise TypeError("expect_unfused needs a reason: @pytest.mark.expect_unfused(\"why nothing is fused\")")
    with fusion_watch.watching() as watch:
        result = yield
    if marker is None:
        watch.check()
    return result
