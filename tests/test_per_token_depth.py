"""Per-token depth training (recipe depth_mode "per_token", issue 27): each token draws its own depth
and is frozen past it as the exact harness freezes a halted token."""
import pytest
import torch
import torch.nn.functional as F
from tiny import make_tiny_hops_checkpoint

from recur_core import LoopedLM, load_checkpoint
from recur_core.analysis.harness import run_exact
from recur_core.exits.policies import Policy
from recur_core.model.checkpoint import CheckpointError, read_safetensors
from recur_core.model.config import ModelConfig
from recur_core.model.recipe import Recipe
from recur_core.settings import seed_for
from training.depth_sampler import sample_token_depths

CFG = ModelConfig(vocab_size=37, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=48, n_prelude=1, n_core=2,
                  n_coda=1, max_seq_len=23)


def model_and_ids(seed=0, batch=3, length=19):
    torch.manual_seed(seed)
    model = LoopedLM(CFG)
    ids = torch.randint(0, CFG.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed + 1))
    return model, ids


def loss_and_grads(model, ids, loops, k, token_loops=None):
    model.zero_grad(set_to_none=True)
    logits = model(ids, loops, torch.Generator().manual_seed(5), backprop_depth=k, token_loops=token_loops)
    loss = F.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loops,k", [(5, 2), (3, 3), (4, 6)])
def test_every_depth_equal_to_r_is_the_papers_recipe_at_r(loops, k):
    """Same loss, same gradients, bit for bit: per-token depth adds nothing when every token draws r."""
    model, ids = model_and_ids()
    loss_a, grads_a = loss_and_grads(model, ids, loops, k)
    loss_b, grads_b = loss_and_grads(model, ids, loops, k, torch.full(ids.shape, loops))
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)


def capture_core_states_and_keys(model):
    """Per-loop (state after the loop, keys of every core attention) recorded by forward hooks."""
    states, keys = [], []
    for block in model.core_blocks:
        block.attn.kv_proj.register_forward_hook(lambda m, i, out: keys.append(out.detach().clone()))
    real_core_step = model.core_step

    def core_step(*args, **kwargs):
        out = real_core_step(*args, **kwargs)
        states.append(out.detach().clone())
        return out

    model.core_step = core_step
    return states, keys


def test_a_frozen_tokens_state_and_keys_do_not_change_after_its_depth():
    model, ids = model_and_ids(batch=2, length=17)
    depths = torch.randint(1, 7, ids.shape, generator=torch.Generator().manual_seed(3))
    depths[0, 4] = 1  # one token frozen from the first loop, one running to the end
    depths[1, 9] = 6
    states, keys = capture_core_states_and_keys(model)
    with torch.no_grad():
        model(ids, 6, torch.Generator().manual_seed(5), backprop_depth=2, token_loops=depths)
    assert len(states) == 6
    n_core = len(model.core_blocks)
    first_keys = [keys[i * n_core] for i in range(6)]  # the first core block's keys, loop by loop
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1]):
            d = int(depths[b, t])
            for i in range(d, 6):  # loops d + 1 .. 6 (0-based i) leave it as loop d left it
                assert torch.equal(states[i][b, t], states[d - 1][b, t])
            for i in range(d + 1, 6):  # keys read at loop i + 1 come from the state after loop i
                assert torch.equal(first_keys[i][b, t], first_keys[d][b, t])
    assert not torch.equal(states[5][1, 9], states[4][1, 9])  # a token still running keeps changing


def test_frozen_token_is_what_the_exact_harness_computes():
    """A loop-by-loop run that freezes each token after its depth (core_step's freeze, the exact
    harness's rule) gives the same logits as forward with token_loops."""
    model, ids = model_and_ids(seed=2)
    depths = torch.randint(1, 5, ids.shape, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = model(ids, 4, torch.Generator().manual_seed(5), token_loops=depths)
        e = model.prelude(ids)
        state = model.start_state(model.init_state(*ids.shape, torch.Generator().manual_seed(5)), e)
        for i in range(1, 5):
            state = model.core_step(state, e, freeze=depths < i)
        want = model.readout(state)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class FixedDepths(Policy):
    """Halts token t of one window after loop depth[t]: a fixed per-token depth as an exit policy."""

    threshold_name = "min_loops"

    def __init__(self, depth: torch.Tensor):
        super().__init__()
        self.depth = depth

    def _rule_online(self, loop, signals):
        return (self.depth[:signals.shape[-1]] <= loop).expand(signals.shape)  # a lane may be cut short


def test_forward_with_token_loops_is_the_exact_harness_at_those_depths():
    """The oracle of training's own freezing (LoopedLM.forward, which may not import the halting
    contract): the exact harness halting each token at its depth gives the same exits, losses and
    predictions, window by window from the same noise."""
    model, ids = model_and_ids(seed=4, batch=2, length=20)
    depths = torch.randint(1, 6, (2, 19), generator=torch.Generator().manual_seed(9))
    for window, depth in zip(ids, depths, strict=True):
        exact = run_exact(model, window[None], FixedDepths(depth), 5, seed=11)
        with torch.no_grad():
            logits = model(window[None, :-1], 5, torch.Generator().manual_seed(seed_for(11, 0)), token_loops=depth[None])
        assert exact.exit_depth.tolist() == [depth.tolist()] and exact.converged.all()
        ce = F.cross_entropy(logits[0].float(), window[1:], reduction="none")
        torch.testing.assert_close(torch.from_numpy(exact.ce[0]), ce, rtol=1e-5, atol=1e-5)
        assert exact.argmax[0].tolist() == logits[0].argmax(-1).tolist()


def test_gradients_reach_only_each_tokens_own_last_k_loops():
    """A token's backprop window is its own last k loops: the state it has before them gets no gradient."""
    model, ids = model_and_ids(batch=1, length=9)
    depths = torch.tensor([[5, 1, 5, 2, 5, 3, 5, 4, 5]])
    k, outputs = 2, []
    real_core_step = model.core_step

    def core_step(*args, **kwargs):
        out = real_core_step(*args, **kwargs)
        out.retain_grad()
        outputs.append(out)
        return out

    model.core_step = core_step
    logits = model(ids, 5, torch.Generator().manual_seed(5), backprop_depth=k, token_loops=depths)
    logits.sum().backward()
    # outputs[j - 1] is the state after loop j, which loop j + 1 reads: inside token t's window iff
    # j + 1 > depth_t - k (a frozen token's state passes on unchanged, so its exit state is in it)
    for j, state in enumerate(outputs[:-1], start=1):
        for t in range(ids.shape[1]):
            has_grad = bool(state.grad[0, t].abs().sum() > 0)
            assert has_grad == (j + 1 > int(depths[0, t]) - k), (j, t)


def test_token_depth_sampler_draws_r_or_uniform_below_and_is_seeded():
    d = sample_token_depths(3, 6, (64, 64), 0.5, seed=1)
    assert d.min() >= 1 and d.max() <= 6 and d.dtype == torch.int64
    share_r = (d == 6).float().mean().item()
    assert share_r == pytest.approx(0.5 + 0.5 / 6, abs=0.03)  # kept r, or drew r uniformly
    assert torch.equal(d, sample_token_depths(3, 6, (64, 64), 0.5, seed=1))
    assert not torch.equal(d, sample_token_depths(4, 6, (64, 64), 0.5, seed=1))
    assert not torch.equal(d, sample_token_depths(3, 6, (64, 64), 0.5, seed=1, rank=1))
    assert torch.equal(sample_token_depths(3, 6, (4, 5), 0.0), torch.full((4, 5), 6))
    with pytest.raises(ValueError, match="token_share"):
        sample_token_depths(3, 6, (4, 5), 1.5)
    with pytest.raises(ValueError, match="token_loops"):
        model, ids = model_and_ids()
        model(ids, 3, token_loops=torch.full(ids.shape, 4))


def test_tiny_per_token_run_records_the_mode_and_resumes_exactly(tmp_path):
    straight = make_tiny_hops_checkpoint(tmp_path / "a", steps=12, depth_mode="per_token", token_share="0.5",
                                         log_every="1", ckpt_every="5", eval_every="5")
    meta = load_checkpoint(straight).meta
    assert meta["recipe"]["depth_mode"] == "per_token" and meta["recipe"]["token_share"] == 0.5
    assert Recipe.from_meta(meta).depth_mode == "per_token"
    assert "per-token depth (50% of tokens" in Recipe.from_meta(meta).describe()
    rows = [r for r in map(__import__("json").loads, (straight.parent / "metrics.jsonl").read_text().splitlines())
            if r["event"] == "train"]
    assert all(1 <= r["mean_token_loops"] <= r["r"] for r in rows)
    assert any(r["mean_token_loops"] < r["r"] for r in rows)
    stopped = tmp_path / "b"
    kwargs = dict(depth_mode="per_token", token_share="0.5", log_every="1", ckpt_every="5", eval_every="5")
    make_tiny_hops_checkpoint(stopped, steps=12, trainer_kwargs={"stop_at_step": 7}, **kwargs)
    make_tiny_hops_checkpoint(stopped, steps=12, trainer_kwargs={"resume": True}, **kwargs)
    a = read_safetensors(straight / "model.safetensors")
    b = read_safetensors(stopped / "run" / "latest" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_paper_recipe_checkpoints_read_as_per_step(tmp_path):
    old = Recipe.from_meta({"recipe": {"r_bar": 8, "r_max": 24, "k": 8, "sigma": 0.5, "sampler_mean": "r_bar"}})
    assert old.depth_mode == "per_step" and old.defaulted == () and "per-token" not in old.describe()
    with pytest.raises(ValueError, match="depth_mode"):
        Recipe(4.0, 16, 4, 0.5, depth_mode="per_layer")


def test_init_from_starts_from_the_weights_and_records_them(tmp_path):
    base = make_tiny_hops_checkpoint(tmp_path / "base", steps=6)
    tuned = make_tiny_hops_checkpoint(tmp_path / "tuned", steps=3, depth_mode="per_token",
                                      trainer_kwargs={"init_from": base})
    meta = load_checkpoint(tuned).meta
    assert meta["init_from"]["checkpoint_id"] == load_checkpoint(base).checkpoint_id
    assert meta["init_from"]["recipe"]["depth_mode"] == "per_step"
    # three steps from the base weights stay near them; a fresh start would not
    a, b = read_safetensors(base / "model.safetensors"), read_safetensors(tuned / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 0.05
    with pytest.raises(CheckpointError, match="model config differs"):
        make_tiny_hops_checkpoint(tmp_path / "wide", steps=2, d_model="48", trainer_kwargs={"init_from": base})
