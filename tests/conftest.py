"""Shared test set-up.

One intra-op thread per test process: the suite runs with ``pytest -n 2`` on small
machines, where two workers each using every core slow tiny kernels down by orders of
magnitude (oversubscription).
"""
import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread_per_worker():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
