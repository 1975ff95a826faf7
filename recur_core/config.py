"""Model configuration of a depth-recurrent (looped) transformer, with a JSON round trip."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    n_prelude: int
    n_core: int
    n_coda: int
    max_seq_len: int = 256
    rope_base: float = 10_000.0
    norm_eps: float = 1e-6
    state_init_std: float = math.sqrt(2 / 5)  # the paper's std of the initial recurrent state
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dim must be even for RoPE")
        for name in ("vocab_size", "d_model", "ffn_dim", "n_core", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))
