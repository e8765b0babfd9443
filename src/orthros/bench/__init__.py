"""Benchmarks: prefill latency against prompt length, and pre-training step time."""
