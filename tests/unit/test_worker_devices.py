"""`trainyard worker --devices`: what a host offers, and a clear message for what it can't."""

from __future__ import annotations

import logging

import pytest
import torch

from trainyard.cli import main
from workers.host import parse_devices


def test_cpu_slots_are_counted():
    assert parse_devices("cpu:4") == ("cpu", 4, {})


@pytest.mark.parametrize(
    "devices, reason",
    [
        ("cpu:0", "expected cpu:N with N >= 1"),
        ("cpu:two", "expected cpu:N with N >= 1"),
        ("cuda:a", "expected cuda:all or GPU indices"),
        ("cuda:0,,1", "expected cuda:all or GPU indices"),
        ("tpu:1", "expected cpu:N, cuda:all or cuda:0,1"),
    ],
)
def test_devices_a_host_cannot_offer_are_refused_naming_the_option(devices, reason):
    with pytest.raises(ValueError, match=reason):
        parse_devices(devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a GPU")
def test_cuda_on_a_host_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        parse_devices("cuda:all")


def test_the_worker_command_says_what_is_wrong_without_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINYARD_DATA_DIR", str(tmp_path))
    # The command points the root logger at this test's captured stderr, closed after it: later tests
    # that log would print "--- Logging error ---" into the stderr they assert on. Restore it after.
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    assert main(["worker", "--host-name", "h", "--devices", "cpu:0"]) == 2
    err = capsys.readouterr().err
    assert "--devices 'cpu:0': expected cpu:N with N >= 1" in err and "Traceback" not in err
