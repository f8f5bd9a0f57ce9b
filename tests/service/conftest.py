"""Fixtures shared by the API tests: each module brings its own users, and its `settings_overrides` if any."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.api.main import create_app


@pytest.fixture
def api(settings) -> TestClient:
    """The API app on the module's settings, called in-process."""
    return TestClient(create_app(settings))
