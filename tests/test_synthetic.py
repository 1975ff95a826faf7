"""bench.synthetic writes folders in the published formats; shrunk here (same keys, small widths) so
the test writes kilobytes, not the 7 GB of Huginn-0125."""
import json

import pytest
import torch

from bench import synthetic
from recur_core import describe_folder, load_checkpoint
from recur_core.model.hf_folder import INDEX

SMALL = {"huginn-0125": {"n_embd": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96,
                         "vocab_size": 512, "init_values": {"std": (2 / (5 * 64)) ** 0.5, "embed_scale": 8.0}},
         "ouro-1.4b": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
                       "intermediate_size": 96, "vocab_size": 512, "num_hidden_layers": 3,
                       "layer_types": ["full_attention"] * 3}}


@pytest.mark.parametrize("model", ["huginn-0125", "ouro-1.4b"])
def test_a_synthetic_folder_is_the_published_format_and_loads(model, tmp_path, monkeypatch):
    hf, shapes_of, fixture = synthetic.MODELS[model]
    monkeypatch.setitem(synthetic.MODELS, model, ({**hf, **SMALL[model]}, shapes_of, fixture))
    out = tmp_path / model
    r = synthetic.write(model, out, seed=0, shard_gb=1e-4)  # 100 KB shards: several
    index = json.loads((out / INDEX).read_text())
    assert r["files"] >= 3 and len(set(index["weight_map"].values())) == r["files"]
    assert index["metadata"]["total_size"] == r["bytes"] == 2 * r["n_params"]
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["model_type"] == hf["model_type"]
    assert {k for k in hf if k not in SMALL[model]} <= set(config)  # every published key kept
    info = describe_folder(out)
    assert info["dtype"] == "bfloat16" and info["n_params"] == r["n_params"]
    ckpt = load_checkpoint(out)
    assert {p.dtype for p in ckpt.model.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        logits = ckpt.model(torch.arange(12)[None], loops=2, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(logits).all()
    again = tmp_path / "again"
    synthetic.write(model, again, seed=0, shard_gb=1e-4)
    assert load_checkpoint(again).checkpoint_id == ckpt.checkpoint_id  # seeded: the same folder


def test_refuses_an_unknown_model_or_a_full_folder(tmp_path):
    with pytest.raises(SystemExit, match="unknown model"):
        synthetic.write("llama", tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    with pytest.raises(SystemExit, match="not empty"):
        synthetic.write("ouro-1.4b", tmp_path / "full")
