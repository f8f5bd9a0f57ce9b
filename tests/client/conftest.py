from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.client.fake_server import FakeState, serve


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return os.urandom(300_000)


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory, model_bytes) -> tuple[str, FakeState]:
    # One server per test module keeps the tests fast; `fake_api` gives each test a fresh state.
    model_file = tmp_path_factory.mktemp("served") / "model.safetensors"
    model_file.write_bytes(model_bytes)
    state = FakeState(model_file)
    with serve(state) as url:
        yield url, state


@pytest.fixture
def fake_api(fake_server) -> tuple[str, FakeState]:
    """The fake API's URL and its state, reset for this test."""
    url, state = fake_server
    state.reset()
    return url, state


@pytest.fixture(autouse=True)
def no_ambient_config(monkeypatch, tmp_path: Path) -> None:
    """Tests see neither the developer's TRAINYARD_* variables, config file nor a .trainyard/token in the checkout."""
    for name in ("TRAINYARD_SERVER", "TRAINYARD_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRAINYARD_CONFIG", str(tmp_path / "no-such-config.yaml"))
    monkeypatch.setenv("TRAINYARD_DATA_DIR", str(tmp_path / "no-such-dir"))

