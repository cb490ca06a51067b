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
from hypothesis import settings

import fusion_watch

fusion_watch.install()

# The suite's outcome depends on the code, never on the run: hypothesis draws the same examples
# every run (derandomized, from each test's name), keeps no database of earlier failures
# between runs and has no per-example deadline (a time limit is the machine's load, not the code). ``pytest --hypothesis-profile=explore`` draws fresh random examples (and saves
# what fails) when looking for new counterexamples.
settings.register_profile("suite", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("suite")


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's controller rebuilds each warning a worker reports by importing the module
    # that defines its category; Lightning's warnings import torchvision, whose fake-kernel
    # registration fails on this CPU torch. Import it the way the tests do, before any worker
    # reports, so that the controller can (else the whole run stops with an INTERNALERROR).
    try:
        from zoo import import_torchvision_without_fake_kernels

        import_torchvision_without_fake_kernels()
    except ImportError:  # torchvision not installed: no warning category can need it
        pass
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


def _marker(item: pytest.Item):
    marker = item.get_closest_marker("expect_unfused")
    if marker is not None and not (marker.args and isinstance(marker.args[0], str) and marker.args[0]):
        raise TypeError("expect_unfused needs a reason: @pytest.mark.expect_unfused(\"why nothing is fused\")")
    return marker


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Watch from the test's set-up on: fixtures that convert (a module's shared converted
    model) are checked with the first test that builds them."""
    _marker(item)
    item.stash[_WATCH] = fusion_watch.start()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """After the test body passed, fail it if it (or its set-up) converted a model that fused
    nothing or ran a chain unfused (:meth:`fusion_watch.Watch.check`)."""
    watch = item.stash.get(_WATCH, None) or fusion_watch.start()
    try:
        result = yield
    finally:
        fusion_watch.stop()
    if _marker(item) is None:
        watch.check()
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    fusion_watch.stop()
    return (yield)


_WATCH = pytest.StashKey()


def _compat_entries() -> tuple:
    """The lines of tests/compat_subset.txt: test files or node id prefixes."""
    from pathlib import Path

    listed = Path(__file__).with_name("compat_subset.txt").read_text().splitlines()
    return tuple(line.strip() for line in listed if line.strip() and not line.startswith("#"))


def _in_compat_subset(nodeid: str, entries: tuple) -> bool:
    return any(nodeid == e or (nodeid.startswith(e) and nodeid[len(e)] in ":[-]") for e in entries)


def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    """Mark the compatibility subset ``compat`` (the tests tests/compat_subset.txt lists):
    ``scripts/test_torch.sh VERSION`` runs them on that torch release."""
    entries = _compat_entries()
    for item in items:
        if _in_compat_subset(item.nodeid, entries):
            item.add_marker(pytest.mark.compat)
