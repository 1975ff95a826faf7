"""Autoregressive decoding with real per-token halting: the KV cache and its rules, batch-1 / lockstep decoding, the pool."""
