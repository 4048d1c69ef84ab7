"""Shared test fixtures live in tests/fixtures/ and are registered here."""
pytest_plugins: list[str] = [
    "tests.fixtures.tiny_gemma4",
]
