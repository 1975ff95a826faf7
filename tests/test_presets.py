"""training.presets: the model shape is a ModelConfig inside TrainConfig (one declaration)."""
import dataclasses
import json
from pathlib import Path

import pytest

from recur_core.model.config import ModelConfig, shape_of
from training.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_reach_the_shape_and_seq_len_is_its_context():
    cfg = PRESETS["demo"].with_overrides({"d_model": "128", "seq_len": "64", "lr": "0.01", "qk_bias": "true"})
    assert cfg.model.d_model == 128 and cfg.model.max_seq_len == cfg.seq_len == 64 and cfg.model.qk_bias
    assert cfg.lr == 0.01 and PRESETS["demo"].model.d_model == 256  # the preset itself is untouched
    built = cfg.model_config(300)
    assert isinstance(built, ModelConfig) and built.vocab_size == 300 and built.max_seq_len == 64
    with pytest.raises(ValueError, match="unknown setting 'vocab_size'"):
        PRESETS["demo"].with_overrides({"vocab_size": "10"})


def test_a_preset_shape_builds_no_model_before_its_tokenizer():
    from recur_core import LoopedLM
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        LoopedLM(PRESETS["hops"].model)


def test_shape_of_reads_both_meta_layouts():
    """The shipped checkpoints' meta.json predates the nested shape; new runs write it nested."""
    old = json.loads((ROOT / "checkpoints/demo/meta.json").read_text())["train_config"]
    config = json.loads((ROOT / "checkpoints/demo/config.json").read_text())
    shape = shape_of(old)
    assert all(shape[k] == config[k] for k in ("d_model", "n_heads", "n_kv_heads", "ffn_dim", "n_prelude", "n_core",
                                                "n_coda", "max_seq_len"))
    new = dataclasses.asdict(PRESETS["hops"])
    assert shape_of(new)["max_seq_len"] == 64 and shape_of(new)["tie_embeddings"] is False
