"""The engine core: the engine thread and its queue (scheduler.py), the generation loop and continuous batching
(generation.py), text out of tokens (detokenize.py), the Prometheus metrics (metrics.py). It raises its own errors;
the HTTP layer gives them their status."""
