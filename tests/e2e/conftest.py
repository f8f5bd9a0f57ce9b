"""Fixtures for the end-to-end tests."""

from tests.browser import browser  # noqa: F401  (a fixture: the pages' tests take it by name)
