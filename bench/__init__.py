"""The benchmarks: each script runs from the repository root as `python -m bench.<name>`."""
