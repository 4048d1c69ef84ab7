"""Shared test fixtures live in tests/fixtures/ and are registered here."""
import os

# torch on one thread in every test process, set before anything imports it (the servers the tests start get the
# same from devtools/server.py): the two pytest-xdist workers share two cores, tiny matmuls gain nothing from threads,
# and a float32 result then does not depend on the machine's core count (tests/fixtures/tolerances.py).
os.environ["OMP_NUM_THREADS"] = "1"

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
