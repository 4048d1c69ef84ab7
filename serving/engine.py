"""The seam between the OpenAI API layer and a model runtime (PyTorch or JAX).

A runtime holds one sequence at a time (the API layer serialises requests behind a fair queue). It turns token
ids into next-token logits; tokenisation, the chat template, sampling, stop conditions and detokenisation are the
API layer's, so both runtimes behave the same on the wire.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class Engine(Protocol):
    #: largest prompt + generated length the runtime accepts
    max_context: int

    def start(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """Reset the sequence, run the prompt, return float32 logits [vocab] for the next token."""

    def step(self, token_id: int) -> np.ndarray:
        """Append one token to the sequence, return float32 logits [vocab] for the next one."""
