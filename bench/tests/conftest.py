"""The bench tests use the product tests' fixtures and their `cuda` skip (tests/conftest.py), defined once there."""

from tests.conftest import demo_scene, pytest_collection_modifyitems  # noqa: F401
