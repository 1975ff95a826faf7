"""One settings object and one recipe reader (issue 12, items 9 and 10): the analyze CLI and the app
read the same SETTINGS, so their headline figures agree; every recipe consumer reads Checkpoint.recipe."""
import dataclasses
import json
import math
import shutil

import numpy as np
import pytest

from recur_core import load_checkpoint
from recur_core.model.recipe import Recipe
from recur_core.settings import SETTINGS

DEMO = "checkpoints/demo"


# -- the recipe ---------------------------------------------------------------------------------------
def test_recipe_reads_meta_and_fills_missing_fields_by_one_rule():
    full = Recipe.from_meta({"recipe": {"r_bar": 4, "r_max": 16, "k": 4, "sigma": 0.5, "sampler_mean": "huginn"}})
    assert (full.r_bar, full.r_max, full.k, full.sigma, full.sampler_mean, full.defaulted) == (
        4.0, 16, 4, 0.5, "huginn", ())
    old = Recipe.from_meta({"recipe": {"r_bar": 8, "r_max": 32, "k": 8, "sigma": 0.5}})  # before sampler_mean
    assert old.sampler_mean == "r_bar" and old.defaulted == ("sampler_mean",)
    # the paper's table: r_max = 4 r_bar, k = r_bar, sigma 0.5; nothing recorded: S1 (8 / 32)
    assert Recipe.from_meta({"recipe": {"r_bar": 3}}).to_meta() == {
        "r_bar": 3.0, "r_max": 12, "k": 3, "sigma": 0.5, "sampler_mean": "r_bar", "depth_mode": "per_step",
        "token_share": 0.0}
    assert (Recipe.from_meta({"recipe": {"r_max": 16}}).r_bar, Recipe.from_meta({}).r_max) == (4.0, 32)
    assert Recipe.from_meta(None).defaulted == ("r_bar", "r_max", "k", "sigma", "sampler_mean")
    assert Recipe.from_meta({"recipe": {"r_bar": 40, "r_max": 16}}).depth == 16  # r̄ as a loop count, capped
    with pytest.raises(ValueError, match="sampler_mean"):
        Recipe.from_meta({"recipe": {"r_bar": 4, "sampler_mean": "paper"}})
    # a null field counts as missing (a Huginn config without mean_backprop_depth)
    assert Recipe.from_meta({"recipe": {"r_bar": 32, "r_max": 64, "k": None}}).k == 32


def test_huginn_folders_record_huginns_sampler():
    from pathlib import Path

    recipe = load_checkpoint(Path(__file__).parent / "fixtures" / "huginn_tiny").recipe
    assert recipe.sampler_mean == "huginn" and recipe.sigma == 0.5 and recipe.r_max == 2 * recipe.r_bar


def test_every_reader_uses_the_checkpoint_recipe(tiny_ckpt, tmp_path):
    """A checkpoint whose meta.json lacks r_max: decode, analyze and the app all take 4 r̄ from the rule."""
    from recur_core.decoding.decode import default_max_loops
    from ui.handle import Handle

    ckpt_dir = tmp_path / "no_r_max"
    shutil.copytree(tiny_ckpt, ckpt_dir)
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    del meta["recipe"]["r_max"]
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))
    ckpt = load_checkpoint(ckpt_dir)
    assert ckpt.recipe.r_max == 12 and ckpt.recipe.defaulted == ("r_max",)
    assert default_max_loops(None, ckpt, None) == 12
    m = Handle.open(str(ckpt_dir), "cpu")
    assert (m.r_max, m.r_bar, m.loops) == (12, 3, SETTINGS.min_trace_loops)


# -- the settings -------------------------------------------------------------------------------------
def test_the_cli_and_the_app_take_their_defaults_from_settings():
    from recur_core.analyze import parse_args
    from ui import compute

    args = parse_args(["ckpt"])
    assert (args.windows, args.seed, args.n_boot, args.probe_windows, args.probe_tokens) == (
        SETTINGS.windows, SETTINGS.seed, SETTINGS.n_boot, SETTINGS.probe_windows, SETTINGS.probe_tokens)
    assert compute.S is SETTINGS
    # the app's ε slider stops are the report's A1 grid (0 and inf aside)
    assert [10.0 ** x for x in SETTINGS.eps_log10] == list(SETTINGS.eps_grid[1:-1])
    assert -3.0 in SETTINGS.eps_log10 and SETTINGS.eps_grid[0] == 0.0 and math.isinf(SETTINGS.eps_grid[-1])


@pytest.mark.slow
def test_app_headline_figures_equal_report_json_on_the_demo_checkpoint(tmp_path, monkeypatch):
    """analyze and the app on checkpoints/demo with the same settings (4 windows, 8 probe windows and
    200 bootstrap replicates, to keep the test short): elasticity, convergence and every allocation
    figure (curves, matched-depth table, loops to match A0 at r̄) are equal, on the exact path (the
    report's headline `allocation`, the app's Exact mode) and on the fast one."""
    from recur_core import analyze
    from recur_core.analysis.curves import json_safe
    from ui import compute
    from ui.handle import Handle

    small = dataclasses.replace(SETTINGS, windows=4, probe_windows=8, n_boot=200)
    monkeypatch.setattr(compute, "S", small)
    monkeypatch.setenv("RECUR_CACHE_DIR", str(tmp_path / "cache"))
    analyze.main([DEMO, "--windows", "4", "--probe-windows", "8", "--n-boot", "200", "--out", str(tmp_path / "report"),
                  "--cache-dir", str(tmp_path / "cache")])
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["allocation"]["path"] == "exact" and report["allocation_fast"]["path"] == "fast"

    m = Handle.open(DEMO, "cpu")
    assert (m.r_max, m.r_bar) == (report["settings"]["r_max"], report["settings"]["r_bar"])
    fast = json_safe(m.sweep_fast(None)["report"])
    exact = json_safe(m.sweep_exact(None, small.windows)["report"])
    keys = [k for k in report["allocation"] if k.endswith("_loops_to_match_a0_rbar")]
    keys += ["matched_depth", "A0", "A1", *(k for k in report["allocation"] if k.startswith("A2_"))]
    assert len(keys) >= 12  # A1 and the four A2 label kinds, their curves and the matched-depth table
    for key in keys:
        assert fast[key] == report["allocation_fast"][key], key
        assert exact[key] == report["allocation"][key], key
    assert json_safe(m.elasticity()) == report["elasticity"]
    assert json_safe(m.convergence(None)) == report["convergence"]
    assert np.isfinite(report["allocation"]["a1_loops_to_match_a0_rbar"]["value"])


def test_seed_for_keeps_the_scattered_mixing_bit_identical():
    """seed_for replaced `(seed * 1_000_003 + index)` (modulo 2**63) in the tracer, decoder, data
    order, depth sampler, hops programs and trainer: shipped figures depend on the same numbers."""
    from recur_core.settings import seed_for
    for seed in (0, 1, 7, 12345):
        for index in (0, 1, 3, 7_919, 999_999, 10 ** 9):
            assert seed_for(seed, index) == (seed * 1_000_003 + index) % (2 ** 63)
    assert seed_for(0, 5) != seed_for(1, 5) and seed_for(0, 5) != seed_for(0, 6)


def test_seeded_state_draws_each_row_from_its_own_seed():
    """Row n's initial state is init_state from a generator seeded seed_for(seed, n), whatever
    batch it is drawn in (the trace, the harness and the decoders all start here)."""
    import torch

    from recur_core.model.config import ModelConfig
    from recur_core.model.looped_lm import LoopedLM
    from recur_core.settings import seed_for
    model = LoopedLM(ModelConfig(vocab_size=16, d_model=8, n_heads=2, n_kv_heads=1, ffn_dim=16, n_prelude=1, n_core=1,
                               n_coda=1, max_seq_len=12))
    batch = model.seeded_state([3, 5], seed=2, seq_len=7)
    alone = model.init_state(1, 7, torch.Generator().manual_seed(seed_for(2, 5)))
    assert torch.equal(batch[1:], alone)
    assert torch.equal(model.seeded_state([5], seed=2)[:, :7], alone)  # a prefix of the full-length noise
