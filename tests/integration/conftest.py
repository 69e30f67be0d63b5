"""Integration tests use the server fixtures of tests/conftest.py."""
