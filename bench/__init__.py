"""Benchmarks of outbox-notify; each module runs with `python -m bench.<name>`."""
