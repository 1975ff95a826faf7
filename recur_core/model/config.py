"""Model configuration of a depth-recurrent (looped) transformer, with a JSON round trip."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

VARIANT_FIELDS = ("outer_blocks", "prelude_norm", "qk_bias", "rope_layout", "embed_scale", "state_init",
                  "coda_input_norm", "sandwich", "loop_input", "loop_final_norm", "exit_gate")


VOCAB_FROM_TOKENIZER = 0  # a training preset's shape before its tokenizer is built (no model from it)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # VOCAB_FROM_TOKENIZER in a training preset (training/presets.py)
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
    # Architecture variants (the defaults are this trainer's model; recur_core.model.huginn sets them for
    # Huginn-0125). Only values that differ from these defaults are written to JSON, so the canonical
    # config JSON, and with it the checkpoint_id, of every existing checkpoint stays what it was.
    outer_blocks: str = "prenorm"     # prelude / coda blocks: "prenorm" or "sandwich" (like the core)
    prelude_norm: bool = True         # RMS-norm the prelude output e before it is re-injected
    qk_bias: bool = False             # learned per-head biases added to q and k before RoPE
    rope_layout: str = "half"         # rotated pairs: "half" (x_j, x_j+hd/2) or "interleaved" (x_2j, x_2j+1)
    embed_scale: float = 1.0          # token embeddings are multiplied by this before the prelude
    state_init: str = "normal"        # initial state: "normal" or "trunc_normal" (cut at +-3 std)
    coda_input_norm: bool = False     # the final norm is applied to the state before the coda too
    # recur_core.model.ouro sets these for Ouro: the whole stack loops on its own normed output
    sandwich: str = "sum"             # sandwich blocks: "sum" norm(f(norm(x)) + x), "branch" x + norm(f(norm(x)))
    loop_input: str = "adapter"       # a loop reads adapter(concat(state, e)) from seeded noise, or "state":
                                      # the state alone (no adapter), starting from e (no noise)
    loop_final_norm: bool = False     # the final norm closes every loop; the head reads the state directly
    exit_gate: bool = False           # a learned exit gate sigmoid(w . s_i + b) per token and loop

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head dim must be even for RoPE")
        for name, allowed in (("outer_blocks", ("prenorm", "sandwich")), ("rope_layout", ("half", "interleaved")),
                              ("state_init", ("normal", "trunc_normal")), ("sandwich", ("sum", "branch")),
                              ("loop_input", ("adapter", "state"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be positive (or VOCAB_FROM_TOKENIZER), got {self.vocab_size}")
        for name in ("d_model", "ffn_dim", "n_core", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.loop_final_norm and self.n_coda:
            raise ValueError("loop_final_norm needs n_coda 0 (the head reads the looped state directly)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict:
        """Every field, except the architecture variants that are at their default (see above)."""
        d = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.name in VARIANT_FIELDS and d[f.name] == f.default:
                del d[f.name]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

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


def shape_of(train_config: dict) -> dict:
    """The model-shape fields of a meta.json "train_config": nested under "model", or (runs before
    the shape moved into TrainConfig.model) flat, with the window length as "seq_len"."""
    if "model" in train_config:
        return train_config["model"]
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    flat = {k: v for k, v in train_config.items() if k in names}
    return {**flat, "max_seq_len": train_config["seq_len"]}
