"""Benchmark harness: iotqueue step throughput and hand-off latency against raw Celery chains.

Run with `python -m bench` (or `make bench`); see bench/README.md for what each number means.
"""
