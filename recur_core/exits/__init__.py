"""What a token's exit is decided from: readout statistics, per-loop signals, and the exit policies."""
