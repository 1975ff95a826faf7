"""Huginn-0125's on-disk format (recur_core.model.huginn) against the reference implementation's outputs.

The fixture tests/fixtures/huginn_tiny is a small random model saved by seal-rg/recurrent-pretraining's
code in the hub's format, with that code's logits after r = 1..32 loops from a zero and from a given
initial state. No transformers and no ../shared needed.
"""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_app import generated_exits, strips

from recur_core import CheckpointError, ModelConfig, load_checkpoint
from recur_core.analysis.harness import run_exact
from recur_core.analysis.trace import trace
from recur_core.decoding.decode import full_depth_logits, generate
from recur_core.exits.policies import ArgmaxStable, ConvergenceExit, CosineExit, EntropyDiff, LatentDiff, ReverseKLExit
from recur_core.exits.signals import LoopSignals
from recur_core.model.formats import describe_folder
from recur_core.model.hf_folder import INDEX, memory_estimate
from recur_core.model.huginn import describe_huginn, huginn_config, huginn_shapes, load_huginn

FIXTURE = Path(__file__).parent / "fixtures" / "huginn_tiny"
REF = load_file(str(FIXTURE / "reference_outputs.safetensors"))
# float32 tolerance of our logits against the reference's: measured max |diff| is 1.2e-6 on logits
# of magnitude <= 2.8 (different op order of the same float32 math); 1e-5 leaves room for other BLAS.
ATOL, RTOL = 1e-5, 1e-5


@pytest.fixture(scope="module")
def huginn():
    return load_checkpoint(FIXTURE)


def loop_logits(model, ids, state, loops):
    """{r: logits after r loops} from a given initial state, through the step API."""
    out = {}
    with torch.no_grad():
        e = model.prelude(ids)
        for r in range(1, max(loops) + 1):
            state = model.core_step(state, e)
            if r in loops:
                out[r] = model.readout(state)
    return out


# -- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("init", ["zero", "given"])
def test_logits_equal_the_reference(huginn, init):
    ids = REF["input_ids"]
    loops = sorted(int(k.rsplit("_r", 1)[1]) for k in REF if k.startswith(f"logits_{init}_state_r"))
    assert loops == ([1, 2, 3, 4, 8, 16, 32] if init == "zero" else [1, 4, 16])
    state = torch.zeros(2, 24, 64) if init == "zero" else REF["input_states"]
    for r, logits in loop_logits(huginn.model, ids, state, loops).items():
        torch.testing.assert_close(logits, REF[f"logits_{init}_state_r{r}"], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, r=r: f"r = {r}: {m}")


def test_config_translation(huginn):
    cfg = huginn.config
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda, cfg.n_heads, cfg.max_seq_len) == (2, 2, 2, 4, 128)
    assert cfg.embed_scale == 8.0 and cfg.state_init_std == pytest.approx((2 / 5) ** 0.5)
    assert cfg.rope_layout == "interleaved" and cfg.rope_base == 50_000 and not cfg.prelude_norm
    assert huginn.meta["dtype"] == "float32" and huginn.meta["recipe"]["r_bar"] == 8
    # the real model's config (recpre/raven_config_minimal.json's values): 55 heads, d 5280
    real = {"model_type": "huginn_raven", "n_embd": 5280, "num_attention_heads": 55, "num_key_value_heads": 55,
            "intermediate_size": 17920, "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4,
            "n_layers_in_coda": 2, "block_size": 4096, "vocab_size": 65536, "mean_recurrence": 32}
    big, recipe = huginn_config(real)
    assert big.head_dim == 96 and big.state_init_std == pytest.approx((2 / 5) ** 0.5)
    assert recipe["r_bar"] == 32
    assert 3.4e9 < memory_estimate(big, huginn_shapes(big), torch.bfloat16)["n_params"] < 3.7e9


def test_initial_state_is_truncated_normal(huginn):
    s = huginn.model.init_state(4, 128, torch.Generator().manual_seed(0))
    std = huginn.config.state_init_std
    assert s.abs().max() <= 3 * std + 1e-6
    assert 0.9 * std < s.std() < std  # a normal cut at 3 sigma has std 0.986 sigma


def test_existing_configs_keep_their_json_and_ids(ckpt, tiny_ckpt):
    """New ModelConfig fields are written only when not default: old configs hash as before."""
    assert ckpt.checkpoint_id == json.loads((tiny_ckpt / "meta.json").read_text())["checkpoint_id"]
    for name in ("demo", "demo-r8"):
        path = Path(__file__).parents[1] / "checkpoints" / name
        assert ModelConfig.from_json((path / "config.json").read_text()).to_json() == \
            (path / "config.json").read_text().strip()
        assert load_checkpoint(path).checkpoint_id == json.loads((path / "meta.json").read_text())["checkpoint_id"]


# -- formats and refusals -------------------------------------------------------------------------
def copy_fixture(dest: Path, weights: bool = True) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json") + (("model.safetensors",) if weights else ()):
        shutil.copyfile(FIXTURE / name, dest / name)
    return dest


def make_sharded(dest: Path) -> Path:
    """The fixture split into two shards plus a model.safetensors.index.json, like the hub's."""
    copy_fixture(dest, weights=False)
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(dest / shard), metadata={"format": "pt"})
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (dest / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return dest


def test_sharded_loads_the_same_as_single_file(huginn, tmp_path):
    sharded = load_checkpoint(make_sharded(tmp_path / "sharded"))
    assert sharded.checkpoint_id == huginn.checkpoint_id
    one, two = huginn.model.state_dict(), sharded.model.state_dict()
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    ids = REF["input_ids"]
    with torch.no_grad():
        assert torch.equal(sharded.model(ids, 3, torch.Generator().manual_seed(0)),
                           huginn.model(ids, 3, torch.Generator().manual_seed(0)))


def test_refuses_pickles(tmp_path):
    only_bin = copy_fixture(tmp_path / "bin", weights=False)
    torch.save({"x": torch.zeros(2)}, only_bin / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle files .*pytorch_model.bin.*never unpickled"):
        load_checkpoint(only_bin)
    disguised = copy_fixture(tmp_path / "disguised", weights=False)
    torch.save({"x": torch.zeros(2)}, disguised / "model.safetensors")
    with pytest.raises(CheckpointError, match="pickle / torch.save file.*refusing to unpickle"):
        load_checkpoint(disguised)


def test_refuses_a_missing_shard(tmp_path):
    folder = make_sharded(tmp_path / "sharded")
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors is missing"):
        load_checkpoint(folder)


def test_refuses_another_model_type(tmp_path):
    folder = copy_fixture(tmp_path / "llama")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        load_checkpoint(folder)


def test_refuses_a_tensor_of_the_wrong_shape(tmp_path):
    folder = copy_fixture(tmp_path / "shape", weights=False)
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    tensors["transformer.core_block.1.mlp.fc.weight"] = torch.zeros(255, 64)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"core_block.1.mlp.fc.weight has shape \(255, 64\) in the weights, "
                                              r"\(256, 64\) expected"):
        load_checkpoint(folder)


def test_describe_reads_headers_only_and_agrees_with_the_load(huginn, tmp_path):
    info = describe_folder(FIXTURE)
    assert info["format"] == "huginn_raven" and info["dtype"] == "float32"
    assert info["n_params"] == huginn.model.num_params() == info["memory_estimate"]["n_params"]
    assert info["weights_bytes"] == (FIXTURE / "model.safetensors").stat().st_size
    for opener in (describe_huginn, load_huginn):  # the format's own entry points, not only the dispatch
        with pytest.raises(CheckpointError, match="no such checkpoint directory"):
            opener(tmp_path / "absent")


def test_refuses_a_model_too_large_before_loading(tmp_path):
    with pytest.raises(CheckpointError, match="too large for this machine.*need about .* free"):
        load_checkpoint(FIXTURE, max_bytes=100_000)


def test_bfloat16_on_request(huginn):
    bf = load_checkpoint(FIXTURE, dtype="bfloat16")
    assert bf.model.embed.weight.dtype == torch.bfloat16 and bf.meta["dtype"] == "bfloat16"
    assert bf.checkpoint_id != huginn.checkpoint_id  # other weights, other traces
    ids = REF["input_ids"]
    with torch.no_grad():
        s = bf.model.init_state(2, 24, torch.Generator().manual_seed(0))
        assert s.dtype == torch.bfloat16
        logits = bf.model.readout(bf.model.core_step(torch.zeros_like(s), bf.model.prelude(ids)))
    assert (logits.float() - REF["logits_zero_state_r1"]).abs().max() < 0.2


def test_dtype_comes_from_the_tensors_not_config_json(tmp_path):
    folder = copy_fixture(tmp_path / "bf16", weights=False)  # its config.json says torch_dtype float32
    tensors = load_file(str(FIXTURE / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    ck = load_checkpoint(folder)
    assert ck.meta["dtype"] == "bfloat16"
    assert {p.dtype for p in ck.model.parameters()} == {torch.bfloat16}
    assert load_checkpoint(folder, dtype="float32").model.embed.weight.dtype == torch.float32


# -- the workbench on it --------------------------------------------------------------------------
def test_trace_and_exits_on_the_fixture(huginn, tmp_path):
    ids = REF["input_ids"].numpy()
    tr = trace(huginn, ids, 12, seed=0, cache=tmp_path)
    assert tr.kl_prev.shape == tr.kl_prev_reverse.shape == tr.cosine_change.shape == (2, 23, 12)
    assert np.isfinite(tr.kl_prev).all() and (tr.kl_prev_reverse >= 0).all()
    assert not np.allclose(tr.kl_prev, tr.kl_prev_reverse)  # the two directions differ
    a1 = ConvergenceExit(1e-3).exits(tr)
    assert a1.depth.shape == (2, 23) and ((1 <= a1.depth) & (a1.depth <= 12)).all()
    # Huginn's criteria side by side on the same tokens
    for policy in (ReverseKLExit(1e-3), EntropyDiff(1e-3), ArgmaxStable(3), CosineExit(1e-3), LatentDiff(0.03)):
        depth = policy.exit_depth(tr)
        assert depth.shape == (2, 23) and ((1 <= depth) & (depth <= 12)).all()
    assert (EntropyDiff(np.inf).exit_depth(tr) == 2).all()  # never at loop 1
    assert (ArgmaxStable(3).exit_depth(tr) >= 4).all()
    # and the exact harness runs them online
    assert run_exact(huginn, ids[:1], ReverseKLExit(1e-2), 6).exit_depth.shape == (1, 23)


@pytest.mark.parametrize("policy", [ReverseKLExit(1e-3), EntropyDiff(1e-3), ArgmaxStable(2), CosineExit(1e-3),
                                    ArgmaxStable(2, min_loops=3)])
def test_online_rule_equals_the_trace_rule(huginn, tmp_path, policy):
    """Fed a trace's signals loop by loop, the online face holds exactly where the fast path does."""
    tr = trace(huginn, REF["input_ids"].numpy(), 10, seed=1, cache=False)
    fast = policy.exits(tr)
    for loop in range(1, 11):
        i = loop - 1
        signals = LoopSignals(state=torch.zeros(2, 23, 1), state_change=torch.from_numpy(tr.state_change[..., i]),
                              kl_prev=torch.from_numpy(tr.kl_prev[..., i]),
                              kl_prev_reverse=torch.from_numpy(tr.kl_prev_reverse[..., i]),
                              entropy=torch.from_numpy(tr.entropy[..., i]), argmax=torch.from_numpy(tr.argmax[..., i]),
                              cosine_change=torch.from_numpy(tr.cosine_change[..., i]))
        met = policy.rule_met(loop, signals).numpy()
        first = fast.converged & (fast.depth == loop)
        assert not (first & ~met).any()  # where the fast path exits, the rule holds online
        assert not (met & fast.converged & (fast.depth > loop)).any()  # and not earlier


def test_generate_on_the_fixture(huginn):
    """Decoding with exits disabled equals the full forward; with Huginn's entropy-diff it halts."""
    prompt = REF["input_ids"][0, :8].tolist()
    gen = generate(huginn, prompt, 6, None, max_loops=4, greedy=True, seed=0)
    ref = full_depth_logits(huginn, gen.prompt_ids + gen.ids[:-1], 4, seed=0)[len(prompt) - 1:]
    torch.testing.assert_close(gen.logits, ref, atol=1e-4, rtol=0)
    assert gen.ids == [int(r.argmax()) for r in ref]
    halted = generate(huginn, "the cat", 5, EntropyDiff(1e-2), max_loops=16, greedy=True, seed=0)
    assert len(halted.ids) == 5 and all(2 <= e <= 16 for e in halted.exit_loops)


def test_windows_from_a_text(tmp_path):
    ck = load_checkpoint(FIXTURE)
    with pytest.raises(CheckpointError, match="ships no eval_windows.safetensors"):
        ck.windows("eval")
    text = "Once upon a time there was a little cat who liked to sleep in the sun. " * 12
    ck.use_text(text, seq_len=16)
    ev, pr = ck.windows("eval"), ck.windows("probe")
    assert ev.shape[1] == pr.shape[1] == 17 and ev.shape[0] >= 1 and pr.shape[0] >= 1
    with pytest.raises(CheckpointError, match="at least 2 windows"):
        ck.use_text("tiny", seq_len=16)


# -- the app ----------------------------------------------------------------------------------------
def _app(monkeypatch, tmp_path, **env):
    import streamlit as st
    from streamlit.testing.v1 import AppTest
    st.cache_resource.clear()  # a model another test loaded stays cached in this process
    monkeypatch.delenv("RECUR_CHECKPOINT", raising=False)
    monkeypatch.delenv("RECUR_CHECKPOINTS", raising=False)
    monkeypatch.setenv("RECUR_SHIPPED", str(tmp_path / "none"))
    monkeypatch.setenv("RECUR_CACHE_DIR", str(tmp_path / "cache"))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    at = AppTest.from_file("../app.py", default_timeout=300)
    at.run()
    at.text_input(key="typed_path_input").input(str(FIXTURE)).run()
    assert not at.exception, [e.message for e in at.exception]
    return at


def test_app_opens_the_fixture_folder_and_draws_the_token_strip(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path)
    picker = at.selectbox(key="checkpoint_path")
    assert picker.value == str(FIXTURE.resolve())
    assert "params · float32" in picker.format_func(picker.value)
    assert any("on disk · needs ≈" in c.value and "on cpu" in c.value for c in at.sidebar.caption)
    bodies = [el.proto.body for el in at.html if 'data-testid="token-strip"' in el.proto.body]
    assert len(bodies) == 1
    ck = load_checkpoint(FIXTURE)
    from ui.checkpoints import describe
    text = at.session_state[f"text@{describe(FIXTURE).task}"]  # the pasted text is kept per task
    ids = ck.tokenizer().encode(text).ids[:ck.config.max_seq_len]  # the app truncates
    depths = [int(d) for d in re.findall(r'data-testid="token" data-pos="\d+" data-depth="(\d+)"', bodies[0])]
    r_max = ck.meta["recipe"]["r_max"]
    assert depths == generated_exits(ck, ids, ConvergenceExit(1e-3, r_max=r_max)).tolist()  # exact: real decoding
    at.segmented_control(key="text_path_exits").set_value("fast").run()
    fast = ConvergenceExit(1e-3, r_max=r_max).exit_depth(trace(ck, np.array(ids), 32, seed=0, cache=False))
    assert [t["depth"] for t in strips(at)[0]] == fast[0].tolist()


def test_app_explains_a_model_too_large(monkeypatch, tmp_path):
    at = _app(monkeypatch, tmp_path, RECUR_MEMORY_LIMIT="100000")
    assert any("too large for this machine" in e.value for e in at.error)
    assert any("too large" in c.value for c in at.sidebar.caption)


def test_analyze_cli_takes_windows_from_a_text(tmp_path):
    from recur_core.analyze import main
    text = tmp_path / "text.txt"
    text.write_text("The little dog ran to the park, and the cat sat on the warm wall in the sun. " * 10)
    report = main([str(FIXTURE), "--text", str(text), "--seq-len", "24", "--windows", "4", "--max-loops", "6",
                   "--n-boot", "20", "--probe-windows", "4", "--probe-tokens", "16", "--dtype", "float32",
                   "--out", str(tmp_path / "report"), "--cache-dir", str(tmp_path / "cache")])
    assert report["settings"]["windows"] == 4 and report["settings"]["seq_len"] == 24
    assert report["checkpoint"]["checkpoint_id"] == load_checkpoint(FIXTURE).checkpoint_id
    assert len(report["elasticity"]["loss"]) == 6


def test_every_page_opens_the_fixture_folder(monkeypatch, tmp_path):
    """No eval / probe windows ship with it: pages use the pasted text, A2 and elasticity say why not."""
    at = _app(monkeypatch, tmp_path)
    for page in ("compare", "generate", "curve", "convergence", "classes", "elasticity", "training"):
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception, (page, [e.message for e in at.exception])
        assert not at.error, (page, [e.value for e in at.error])
    at.switch_page("pages/compare.py").run()
    assert any("ships none" in i.value for i in at.info)
