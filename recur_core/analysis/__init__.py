"""Measuring a checkpoint loop by loop: traces, their cache, the exact harness, A2's probe, bootstrap, curves, ground truth."""
