"""The server's Prometheus metrics, under vLLM's names and label (serving/api/app.py serves them at /metrics)."""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from serving.core.generation import Finish

disable_created_metrics()


class Metrics:
    """vLLM's names and label, so dashboards and the bench's `gauge` mode read us like a vLLM server."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, ln = self.registry, ["model_name"]
        lat = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0, 160.0, 640.0)
        tok = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from arrival).", ln,
                              buckets=lat, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", ln,
                             buckets=tok, registry=r).labels(model_name)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Per request: (e2e latency - TTFT) / (output tokens - 1).", ln, buckets=tok,
                              registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", ln,
                             buckets=lat, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", ln,
                                         registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", ln,
                                     registry=r).labels(model_name)
        self.success = Counter("vllm:request_success", "Finished requests.", ln + ["finished_reason"], registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests generating now.", ln,
                             registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued.", ln, registry=r).labels(model_name)
        counts = tuple(float(m * 10 ** e) for e in range(7) for m in (1, 2, 5))      # vLLM's 1-2-5 series
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request.", ln,
                                        buckets=counts, registry=r).labels(model_name)
        self.request_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per finished "
                                            "request.", ln, buckets=counts, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to prefill.", ln, buckets=lat,
                                    registry=r).labels(model_name)
        # Never incremented: a slot holds its request's whole context, so no request is ever preempted.
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted.", ln, registry=r).labels(model_name)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Share of the KV cache (slots x context) the running "
                              "requests' tokens fill, 0 to 1.", ln, registry=r).labels(model_name)
        # Not vLLM's: freed heap handed back to the system (serving/shaping/heap.py), at boot and after large requests.
        self.heap_trims = Counter("g5g:heap_trims", "malloc_trim calls (after boot, after large requests).", ln,
                                  registry=r).labels(model_name)
        self.heap_released = Counter("g5g:heap_released_bytes", "Resident bytes those calls gave back.", ln,
                                     registry=r).labels(model_name)
        self.model_name = model_name
        self.lock = threading.Lock()

    # Updates and scrapes hold one lock, so a scrape never sees a request both running and finished:
    # running + waiting + request_success_total (all reasons) = requests accepted so far.
    def set_queue(self, waiting: int, running: int | None = None) -> None:
        with self.lock:
            self.waiting.set(waiting)
            if running is not None:
                self.running.set(running)

    def finished(self, arrival: float, fin: Finish, running: int) -> None:
        """A request ended; `running` is how many still run, set in the same update (see above)."""
        with self.lock:
            self.running.set(running)
            self.success.labels(self.model_name, fin.reason).inc()
            prefilled = fin.completion_tokens > 0 or fin.reason != "abort"
            self.prompt_tokens.inc(fin.prompt_tokens if prefilled else 0)
            self.generation_tokens.inc(fin.completion_tokens)
            self.request_prompt.observe(fin.prompt_tokens if prefilled else 0)
            self.request_generation.observe(fin.completion_tokens)
            times = fin.token_times
            if fin.reason == "abort" or not times:
                return
            ttft, e2e = times[0] - arrival, times[-1] - arrival
            self.ttft.observe(ttft)
            self.e2e.observe(e2e)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
            if len(times) > 1:
                self.tpot.observe((e2e - ttft) / (len(times) - 1))

    def trimmed(self, released: int) -> None:
        with self.lock:
            self.heap_trims.inc()
            self.heap_released.inc(released)

    def scrape(self) -> bytes:
        with self.lock:
            return generate_latest(self.registry)
