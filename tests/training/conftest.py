"""Fixtures for the training-engine tests (tests/training/)."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.helpers import write_labelled_jsonl
from tests.training.support import reset_accelerate


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """One intra-op thread: tiny models run faster so, and don't fight a test run sharing the CPU.

    Every comparison inside a test is between runs made with the same thread count (subprocesses
    get OMP_NUM_THREADS=1 from support.subprocess_env)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def fresh_process_state():
    """Each test starts with no Accelerate singletons and leaves SIGTERM as it found it."""
    previous = signal.getsignal(signal.SIGTERM)
    reset_accelerate()
    yield
    reset_accelerate()
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def labelled_root(tmp_path):
    """A data root holding labels.jsonl: texts whose label shows in their letters."""
    root = tmp_path / "data"
    root.mkdir()
    write_labelled_jsonl(root / "labels.jsonl")
    return root
