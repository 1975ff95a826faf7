"""The looped model: causality, freeze masks, seeding, truncated backprop, config round trip."""
import pytest
import torch

from recur_core import LoopedLM, ModelConfig

CFG = ModelConfig(vocab_size=97, d_model=48, n_heads=6, n_kv_heads=2, ffn_dim=80,
                  n_prelude=1, n_core=2, n_coda=1, max_seq_len=40)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LoopedLM(CFG).eval()


def ids(T=23, seed=1):
    return torch.randint(0, CFG.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))


def test_config_json_round_trip():
    assert ModelConfig.from_json(CFG.to_json()) == CFG
    with pytest.raises(ValueError, match="unknown model config keys"):
        ModelConfig.from_dict({**CFG.__dict__, "bogus": 1})
    with pytest.raises(ValueError, match="n_kv_heads"):
        ModelConfig(**{**CFG.__dict__, "n_kv_heads": 4})


def test_state_init_std_and_shape(model):
    s = model.init_state(3, 40, torch.Generator().manual_seed(0))
    assert s.shape == (3, 40, 48)
    assert abs(s.std().item() - (2 / 5) ** 0.5) < 0.02


@torch.no_grad()
def test_causal_changing_a_later_token_never_changes_earlier_outputs(model):
    x = ids()
    y = x.clone()
    y[:, 15] = (y[:, 15] + 1) % CFG.vocab_size
    a = model(x, 5, torch.Generator().manual_seed(3))
    b = model(y, 5, torch.Generator().manual_seed(3))
    assert torch.allclose(a[:, :15], b[:, :15], atol=1e-5)
    assert not torch.allclose(a[:, 15:], b[:, 15:], atol=1e-3)
    # a prefix gets the same noise and therefore the same outputs as the full text
    c = model(x[:, :10], 5, torch.Generator().manual_seed(3))
    assert torch.allclose(a[:, :10], c, atol=1e-5)


@torch.no_grad()
def test_same_seed_same_output_other_seed_differs(model):
    x = ids()
    a = model(x, 4, torch.Generator().manual_seed(7))
    b = model(x, 4, torch.Generator().manual_seed(7))
    c = model(x, 4, torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@torch.no_grad()
def test_freeze_mask_keeps_frozen_states_bit_identical_and_others_attend_to_them(model):
    x = ids()
    e = model.prelude(x)
    s = model.init_state(*x.shape, torch.Generator().manual_seed(0))
    for _ in range(2):
        s = model.core_step(s, e)
    freeze = torch.zeros(x.shape, dtype=torch.bool)
    freeze[:, ::3] = True
    stepped = model.core_step(s, e, freeze)
    assert torch.equal(stepped[freeze], s[freeze])
    assert not torch.allclose(stepped[~freeze], s[~freeze])
    # unfrozen tokens see frozen ones: perturbing a frozen early state changes later unfrozen tokens
    s2 = s.clone()
    s2[:, 0] += 1.0
    stepped2 = model.core_step(s2, e, freeze)
    assert not torch.allclose(stepped2[:, 1], stepped[:, 1])
    assert torch.equal(stepped2[:, 3], s2[:, 3])


def test_live_rows_with_padding_equal_the_full_step_and_coda(model):
    """core_step / coda on each row's unfrozen positions, padded to a common count (the exact
    harness's batches): the unfrozen outputs equal the full computation's, frozen states are kept,
    and the padding (valid False) changes nothing."""
    x = ids()
    with torch.no_grad():
        e = model.prelude(x)
        s = model.core_step(model.init_state(*x.shape, torch.Generator().manual_seed(2)), e)
        freeze = torch.zeros(x.shape, dtype=torch.bool)
        freeze[0, ::2] = True
        freeze[1, :] = True
        freeze[1, 5] = False
        live = [torch.nonzero(~f).flatten() for f in freeze]
        M = max(len(r) for r in live)
        rows = torch.stack([torch.cat([r, r[-1:].expand(M - len(r))]) for r in live])
        valid = torch.arange(M)[None, :] < torch.tensor([len(r) for r in live])[:, None]
        full = model.core_step(s, e, freeze)
        fast = model.core_step(s, e, freeze, rows=rows, valid=valid)
        torch.testing.assert_close(fast, full, atol=1e-5, rtol=0)
        assert torch.equal(fast[freeze], s[freeze])
        h = model.coda(full, rows=rows, valid=valid)
        torch.testing.assert_close(h[valid], model.coda(full)[freeze.logical_not()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [{}, {"n_core": 1}, {"n_core": 3, "qk_bias": True, "outer_blocks": "sandwich", "rope_layout": "interleaved"},
                                   {"loop_input": "state", "loop_final_norm": True, "n_coda": 0, "n_prelude": 0,
                                    "sandwich": "branch", "exit_gate": True}],
                         ids=["two-block core", "one-block core", "huginn-like", "ouro-like"])
def test_core_entries_are_the_entries_core_step_writes_bit_for_bit(shape):
    """A halted token's entries under "recompute" (`core_entries`: the last core block's keys and
    values only) equal those the full loop writes, at a subset of positions reading earlier entries."""
    from recur_core.decoding.kv import LoopKVCache, SlabKV, core_loop
    torch.manual_seed(1)
    cfg = ModelConfig(**{**CFG.__dict__, **shape})
    model = LoopedLM(cfg).eval()
    B, T = 3, 17
    with torch.inference_mode():
        state, e = torch.randn(B, T, cfg.d_model), model.prelude(ids(T)[:1].expand(B, T))
        inject, pos = model.inject(e), torch.tensor([0, 3, 4, 9, 16])
        full, entries = (LoopKVCache(cfg, B, 1, T, "cpu", torch.float32) for _ in range(2))
        earlier = torch.randn_like(full.core)  # what the earlier positions wrote: the blocks before the last read it
        full.core.copy_(earlier)
        entries.core.copy_(earlier)
        core_loop(model, full, 1, state[:, pos], inject[:, pos], pos)
        model.core_entries(state[:, pos], pos, [SlabKV(k, v, pos) for k, v in entries.core_slabs(1)], inject[:, pos])
    assert torch.equal(entries.core, full.core)
    assert not torch.equal(full.core[:, :, :, :, :, pos], earlier[:, :, :, :, :, pos])


def test_full_forward_is_the_composition_of_the_pieces(model):
    x = ids()
    with torch.no_grad():
        e = model.prelude(x)
        s = model.init_state(*x.shape, torch.Generator().manual_seed(5))
        for _ in range(3):
            s = model.core_step(s, e)
        manual = model.readout(s)
        assert torch.equal(manual, model(x, 3, torch.Generator().manual_seed(5)))


def test_gradients_reach_only_the_last_k_loops():
    torch.manual_seed(0)
    m = LoopedLM(CFG)
    grad_modes = []
    handle = m.adapter.register_forward_hook(lambda mod, inp, out: grad_modes.append(out.requires_grad))
    logits = m(ids(), loops=7, generator=torch.Generator().manual_seed(0), backprop_depth=3)
    handle.remove()
    assert grad_modes == [False] * 4 + [True] * 3
    logits.sum().backward()
    assert m.core_blocks[0].attn.q_proj.weight.grad is not None
    assert m.embed.weight.grad is not None  # the prelude is reached through the re-injection

    # fewer loops than k: every loop gets gradients
    grad_modes.clear()
    m.adapter.register_forward_hook(lambda mod, inp, out: grad_modes.append(out.requires_grad))
    m(ids(), loops=2, generator=torch.Generator().manual_seed(0), backprop_depth=3)
    assert grad_modes == [True, True]


def test_sequence_longer_than_context_is_refused(model):
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model(ids(T=41), 1)


@pytest.mark.parametrize("rows", [1, 7, 128, 129])
def test_linear_equals_the_float32_product_to_bfloat16_rounding(rows):
    """`linear`'s streaming forms (one row: mv; up to SKINNY_ROWS: weight @ x^T) agree with F.linear
    and with the float32 product of the same bfloat16 values, at any leading shape."""
    from recur_core.model.looped_lm import LARGE_WEIGHT, linear
    g = torch.Generator().manual_seed(rows)
    weight = (0.02 * torch.randn(LARGE_WEIGHT // 512, 512, generator=g)).bfloat16()
    x = torch.randn(1, rows, 512, generator=g).bfloat16()
    with torch.inference_mode():
        got = linear(x, weight)
        plain = torch.nn.functional.linear(x, weight)
    assert got.shape == plain.shape == (1, rows, LARGE_WEIGHT // 512) and got.is_contiguous()
    exact = x.float() @ weight.float().T
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=1e-2)
    assert (got == plain).float().mean() > 0.999
