"""Shared test fixtures live in tests/fixtures/ and are registered here."""
pytest_plugins: list[str] = [
    "tests.fixtures.engine",
    "tests.fixtures.registry",
    "tests.fixtures.tiny_gemma4",
    "tests.fixtures.timed_server",
    "tests.fixtures.serving",
    "tests.fixtures.jax_engines",
    "tests.fixtures.vllm_sdist",
    "tests.e2e.plugin",
]
