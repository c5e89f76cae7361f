"""Benchmarks and measurement scripts: run each from the repository root as `python -m bench.<name>`."""
