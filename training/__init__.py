"""Randomized-depth trainer for looped LMs: `python -m training.run {demo,s0,s1}`."""
