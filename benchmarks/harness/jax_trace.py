"""What the benchmarks read from a jax.profiler trace (a ProfileData) beyond its kernels: the host's events."""
from __future__ import annotations


def host_event_ms(profile) -> dict[str, float]:
    """Total ms per event name over every /host plane and thread (nested events each count)."""
    names: dict[str, float] = {}
    for plane in profile.planes:
        if plane.name.startswith("/host"):
            for line in plane.lines:
                for e in line.events:
                    names[e.name] = names.get(e.name, 0.0) + e.duration_ns / 1e6
    return names
