"""Checkpoint directories: round trip, stable id, atomic writes, refusal of bad files."""
import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from recur_core import CheckpointError, LoopedLM, ModelConfig, load_checkpoint, save_checkpoint
from recur_core.model.checkpoint import checkpoint_id, stored_dtype_name

CFG = ModelConfig(vocab_size=50, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=48,
                  n_prelude=1, n_core=1, n_coda=1, max_seq_len=16)
TOKENIZER = '{"version": "1.0", "model": {"type": "BPE"}}'


def saved(tmp_path, seed=0):
    torch.manual_seed(seed)
    model = LoopedLM(CFG)
    path = tmp_path / "ckpt"
    ckpt_id = save_checkpoint(path, model, {"preset": "test", "step": 3}, TOKENIZER)
    return model, path, ckpt_id


def test_round_trip_restores_weights_config_meta_and_id(tmp_path):
    model, path, ckpt_id = saved(tmp_path)
    ckpt = load_checkpoint(path)
    assert ckpt.config == CFG
    assert ckpt.meta["step"] == 3 and ckpt.meta["checkpoint_id"] == ckpt_id == ckpt.checkpoint_id
    for k, v in model.state_dict().items():
        assert torch.equal(ckpt.model.state_dict()[k], v)
    x = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        assert torch.equal(ckpt.model(x, 3, torch.Generator().manual_seed(0)),
                           model.eval()(x, 3, torch.Generator().manual_seed(0)))


def test_checkpoint_id_is_stable_and_sensitive(tmp_path):
    model, _, ckpt_id = saved(tmp_path)
    assert checkpoint_id(CFG, model.state_dict()) == ckpt_id
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["adapter.weight"][0, 0] += 1e-3
    assert checkpoint_id(CFG, state) != ckpt_id
    other_cfg = ModelConfig(**{**CFG.__dict__, "rope_base": 500.0})
    assert checkpoint_id(other_cfg, model.state_dict()) != ckpt_id


def test_overwrite_is_atomic_and_leaves_no_temp_dirs(tmp_path):
    _, path, first = saved(tmp_path, seed=0)
    torch.manual_seed(1)
    second = save_checkpoint(path, LoopedLM(CFG), {"step": 4}, TOKENIZER)
    assert first != second and load_checkpoint(path).checkpoint_id == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    _, path, first = saved(tmp_path)

    def crash(tmp):
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, LoopedLM(CFG), {}, TOKENIZER, after_write=crash)
    assert load_checkpoint(path).checkpoint_id == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_pickle_is_refused_never_loaded(tmp_path):
    model, path, _ = saved(tmp_path)
    torch.save(model.state_dict(), path / "model.safetensors")
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(path)
    (path / "model.safetensors").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(path)


def test_truncated_weights_are_refused(tmp_path):
    _, path, _ = saved(tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_stored_dtype_is_read_from_the_header(tmp_path):
    model, path, _ = saved(tmp_path)
    assert stored_dtype_name(path) == "float32"
    save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    assert stored_dtype_name(path) == "bfloat16"
    (path / "model.safetensors").write_bytes(b"not a header")
    assert stored_dtype_name(path) is None and stored_dtype_name(tmp_path / "nowhere") is None


def test_shape_mismatch_names_the_tensor(tmp_path):
    model, path, _ = saved(tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["adapter.weight"] = torch.zeros(32, 32)
    del state["final_norm.weight"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert "adapter.weight: shape (32, 32) in weights, (32, 64) in config" in str(err.value)
    assert "missing tensor final_norm.weight" in str(err.value)


def test_missing_pieces_and_paths_have_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nope")
    _, path, _ = saved(tmp_path)
    (path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_checkpoint(path)


def test_recovery_after_a_kill_between_renames_or_mid_write(tmp_path):
    from recur_core.model.checkpoint import recover_interrupted
    _, path, first = saved(tmp_path)
    path.rename(tmp_path / "ckpt.old")  # killed after moving the old one aside
    (tmp_path / ".ckpt.tmp-abc").mkdir()  # and a half-written temp dir left behind
    recover_interrupted(path)
    assert load_checkpoint(path).checkpoint_id == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
