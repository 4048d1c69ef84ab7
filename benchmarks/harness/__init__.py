"""What every benchmark needs and none should copy: the result file written as figures come in (results), one
measurement per child process (children), Gemma 4 checkpoints of real shapes with random weights (checkpoint), and
a server booted and measured on the wire (serve), the host's events of a JAX trace (jax_trace)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]      # the checkout: `build.py`, and what children put on PYTHONPATH
