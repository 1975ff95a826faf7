"""Ship a trained checkpoint: copy it without trainer state and write its README (model card).

    python -m recur_core.report.export runs/demo/best checkpoints/demo --command "python -m training.run ..."

Every number in the card is measured here with the product's own code (recur_core.analysis.trace and
recur_core.analysis.curves) on the checkpoint's saved eval windows, with the analysis settings of
recur_core.settings (the ones `python -m recur_core.analyze` and the app use). Its training data
is named by source (sources.py), and it links to docs/DEVIATIONS.md, the deviations from the paper.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import numpy as np

from recur_core.analysis.curves import convergence, elasticity
from recur_core.analysis.ground_truth import GROUND_TRUTH
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.model.checkpoint import SHIPPED_FILES, atomic_write_dir
from recur_core.model.config import shape_of
from recur_core.model.formats import load_checkpoint
from recur_core.model.recipe import Recipe
from recur_core.settings import SETTINGS
from recur_core.tasks import HopsTask, WordProblems, task_of

from .hops_card import export_hops
from .mixture_card import mixture_section
from .sources import VAL_PER_MILLE, Source, identify

CARD_LOOPS = SETTINGS.min_trace_loops  # the card's table runs to loop 32
DEVIATIONS = "../../docs/DEVIATIONS.md"


def bytes_per_token(tokenizer, windows: np.ndarray) -> float:
    """UTF-8 bytes of text per target token (the targets are windows[:, 1:])."""
    targets = windows[:, 1:]
    n_bytes = sum(len(tokenizer.decode(row.tolist()).encode("utf-8")) for row in targets)
    return n_bytes / targets.size


def measure(ckpt_dir: Path) -> dict:
    """Elasticity (loss at 1..32 loops, nats/token and bits/byte) and convergence on the eval windows."""
    ckpt = load_checkpoint(ckpt_dir)
    windows = ckpt.windows("eval")[:SETTINGS.windows].numpy()
    tr = trace(ckpt, windows, CARD_LOOPS, seed=SETTINGS.seed, cache=False, progress=True)
    boot = Bootstrap(tr.n_windows, SETTINGS.n_boot, SETTINGS.seed)
    elastic, conv = elasticity(tr, boot), convergence(tr, boot)
    bpt = bytes_per_token(ckpt.tokenizer(), windows)
    return {"n_windows": int(tr.n_windows), "tokens_per_window": int(tr.seq_len), "bytes_per_token": bpt,
            "loss": elastic["loss"], "loss_ci_low": elastic["loss_ci_low"], "loss_ci_high": elastic["loss_ci_high"],
            "bits_per_byte": [v / math.log(2) / bpt for v in elastic["loss"]],
            "mean_kl_prev": conv["mean_kl_prev"], "frac_moving": conv["frac_moving"],
            "median_convergence_loop": conv["median_convergence_loop"]}


def checks(m: dict, r_bar: int) -> dict:
    """The shipping criteria of the demo checkpoints, evaluated on the measured numbers."""
    loss = m["loss"]
    steps = [loss[i + 1] - loss[i] for i in range(r_bar - 1)]
    return {
        "bits_per_byte_at_r_bar": m["bits_per_byte"][r_bar - 1],
        "monotone_to_r_bar": all(s <= 0.005 for s in steps),
        "drop_1_to_r_bar": loss[0] - loss[r_bar - 1],
        "gap_32_vs_r_bar": loss[31] - loss[r_bar - 1],
        "loss_8_minus_loss_4": loss[7] - loss[3],
        "kl_ratio_2_over_16": m["mean_kl_prev"][1] / max(m["mean_kl_prev"][15], 1e-30),
    }


def saturation_row(c: dict, r_bar: int, loss: list[float]) -> tuple[str, str, bool]:
    """Issue 5's last criterion, at this model's own r̄: r̄ 8 must still gain over 4 loops; any other r̄
    must saturate there (twice r̄'s loops within 0.01 nats of r̄'s; for r̄ 4, loss@8 against loss@4). No `|`
    in the row's text: it would split the Markdown table's cell."""
    if r_bar == 8:
        return ("loss@8 < loss@4 (r̄ 8 still gains)", f"{c['loss_8_minus_loss_4']:+.4f}",
                c["loss_8_minus_loss_4"] < 0)
    far = min(2 * r_bar, len(loss))
    gap = loss[far - 1] - loss[r_bar - 1]
    return f"loss@{far} within 0.01 nats of loss@{r_bar} (saturates at r̄ {r_bar})", f"{gap:+.4f}", abs(gap) <= 0.01


def criteria_table(c: dict, r_bar: int, loss: list[float]) -> str:
    """The demo checkpoints' shipping criteria (issue 5), each with its measured value and verdict."""
    rows = [
        ("loss at r̄ ≤ 1.3 bits/byte", f"{c['bits_per_byte_at_r_bar']:.3f}", c["bits_per_byte_at_r_bar"] <= 1.3),
        ("loss falls monotonically from 1 to r̄ (steps ≤ +0.005)", str(c["monotone_to_r_bar"]),
         c["monotone_to_r_bar"]),
        ("drop from 1 loop to r̄ ≥ 0.10 nats", f"{c['drop_1_to_r_bar']:.4f}", c["drop_1_to_r_bar"] >= 0.10),
        ("loss@32 within 0.03 nats of loss@r̄", f"{c['gap_32_vs_r_bar']:+.4f}", abs(c["gap_32_vs_r_bar"]) <= 0.03),
        ("KL at loop 16 ≥ 100× smaller than at loop 2", f"{c['kl_ratio_2_over_16']:.3g}×",
         c["kl_ratio_2_over_16"] >= 100),
        saturation_row(c, r_bar, loss),
    ]
    lines = ["| criterion | measured | met |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {'yes' if ok else '**no**'} |" for name, value, ok in rows]
    return "## Against the shipping criteria\n\n" + "\n".join(lines)


def saturation_section(name: str, loss: list[float], r_bar: int, other: str, other_loss: list[float],
                       other_r_bar: int) -> str:
    """The paper's hypothesis (useful depth saturates at the training mean r̄), tested on this
    checkpoint and one trained with another r̄: it agrees when the smaller-r̄ model is flat from its
    r̄ to the larger r̄ (within 0.01 nats) while the larger-r̄ model still gains over that span."""
    if r_bar == other_r_bar:
        raise ValueError(f"the saturation test needs two training means; both have r̄ {r_bar}")
    (lo_name, lo, lo_rb), (hi_name, hi, hi_rb) = sorted(
        [(name, loss, r_bar), (other, other_loss, other_r_bar)], key=lambda t: t[2])
    lo_change, hi_change = lo[hi_rb - 1] - lo[lo_rb - 1], hi[hi_rb - 1] - hi[lo_rb - 1]
    agrees = abs(lo_change) <= 0.01 and hi_change < 0
    verdict = "agrees" if agrees else "disagrees"
    return f"""## The saturation hypothesis

The paper's hypothesis is that useful depth saturates at the training mean r̄. Measured on the same
128 eval windows, the pair `{lo_name}` (r̄ {lo_rb}) / `{hi_name}` (r̄ {hi_rb}) **{verdict}** with it: from
{lo_rb} to {hi_rb} loops the loss changes by {lo_change:+.4f} nats at r̄ {lo_rb} and by {hi_change:+.4f} nats at r̄ {hi_rb}
(the hypothesis expects about 0 and below 0). The fall from 1 to {lo_rb} loops is {lo[0] - lo[lo_rb - 1]:.4f} nats
at r̄ {lo_rb} and {hi[0] - hi[lo_rb - 1]:.4f} nats at r̄ {hi_rb}; at 1 loop they score {lo[0]:.4f} and {hi[0]:.4f} nats.
"""


def sampler_sentence(recipe: Recipe) -> str:
    mean = {"r_bar": "E[r] = r̄, ours", "huginn": "E[r] = r̄ + 1, Huginn's code"}[recipe.sampler_mean]
    if "sampler_mean" in recipe.defaulted:
        return (f"sampler mean `\"r_bar\"` ({mean}: this meta.json predates the field, and every run before it "
                "used this sampler)")
    return f"sampler mean `\"{recipe.sampler_mean}\"` ({mean})"


def tokenizer_sentence(meta: dict) -> str:
    spec = str(meta.get("tokenizer", ""))
    if spec.startswith("bpe:"):
        return f"a {meta.get('vocab_size', '')}-token byte-level BPE trained on the training text"
    if spec == "smollm2":
        return "the SmolLM2 tokenizer (49,152 tokens, Apache-2.0, shipped in `training/tokenizers/`)"
    return f"the tokenizer `{spec}` ({meta.get('vocab_size', '')} tokens)"


def epochs_part(meta: dict) -> str:
    """", 1.23 epochs" for a finite training set; nothing for a stream (null, or NaN in older meta)."""
    epochs = meta.get("epochs")
    return "" if epochs is None or epochs != epochs else f", {epochs:.2f} epochs"


def best_sentence(meta: dict) -> str:
    """How best/ was chosen: on disjoint selection windows (runs since the trainer recorded it) or,
    before, on the first eval_windows of the saved eval windows that the analyses also read."""
    tc = meta["train_config"]
    if meta.get("best_selected_on"):
        return (f"lowest validation loss at r̄ on {meta['best_selected_on']}, checked every {tc['eval_every']} "
                "steps and at the last step")
    return (f"lowest validation loss at r̄ on the first {tc['eval_windows']} of the 128 saved eval windows, checked "
            f"every {tc['eval_every']} steps and at the last step. Those windows are also analysed (this card, "
            "`recur_core.analyze`, the app); the trainer now chooses `best/` on validation windows disjoint from "
            "them, and this checkpoint was not retrained")


def validation_sentence(meta: dict) -> str:
    """For a run whose validation text was short (meta.json's "validation"): what the trainer held out
    and the windows it got instead of the usual ones; "" otherwise (and for runs before the record)."""
    v = meta.get("validation", {})
    if not (v.get("enlarged") or v.get("shrunk")):
        return ""
    windows = f"{v['eval_windows']} saved eval windows and {v['selection_windows']} selection windows"
    usual = f"the usual {v['wanted_eval_windows']} + {v['wanted_selection_windows']}"
    got = f"{windows} instead of {usual}" if v["shrunk"] else f"{windows}, {usual}"
    if v["enlarged"]:
        return (f" The usual {VAL_PER_MILLE / 10:g}% validation hold-out was too small for this text, so the trainer held "
                f"{v['documents_held_out']:,} of its {v['documents_total']:,} documents (the first in hash order) "
                f"out of training; they gave {got}.")
    return f" The validation text was short: it gave {got}."


def data_section(meta: dict) -> tuple[str, str]:
    """(the card's Data lines, its license paragraph), from the sources the checkpoint names."""
    found = identify(meta)
    lines = []
    for role, title in (("train", "Training data"), ("validation", "Validation data (the saved eval windows)")):
        items = [s.markdown() if isinstance(s, Source) else s for s in found[role]]
        lines.append(f"- **{title}**:" + "".join(f"\n  - {item}" for item in items or ["not recorded"]))
    sources = [s for role in found.values() for s in role if isinstance(s, Source)]
    licenses = sorted({(s.dataset.split(",")[0], s.license) for s in sources})
    if licenses:
        named = "; ".join(f"{d}: **{lic}**" for d, lic in licenses)
        tokenizer = " and the tokenizer" if str(meta.get("tokenizer", "")).startswith("bpe:") else ""
        license_text = (f"The weights are ours; the eval and probe windows (`eval_windows.safetensors`, "
                        f"`probe_windows.safetensors`){tokenizer} are derived from the data above and stay under "
                        f"its license ({named}).")
    else:
        license_text = ("The weights are ours; the data's source was not recorded, so the license of the eval and "
                        "probe windows is that of the data the run was given.")
    return "\n".join(lines), license_text


def which_sentence(meta: dict, source: str) -> str:
    """Which of the run's checkpoints this is: `best/` (how it was chosen) or another folder, e.g. `latest/`."""
    if source == "best":
        return f"This is the run's `best/` checkpoint: {best_sentence(meta)}."
    return (f"This is the run's `{source}/` checkpoint, its step {meta['step']} (a curriculum's last checkpoint is "
            "its most trained; `best/` is chosen on loss alone).")


def card(name: str, meta: dict, m: dict, c: dict, command: str, machine: str, saturation: str = "",
         source: str = "best") -> str:
    recipe = Recipe.from_meta(meta)
    rb = recipe.depth
    data_lines, license_text = data_section(meta)
    datasets = sorted({s.dataset.split(" (")[0].split(",")[0] for role in identify(meta).values() for s in role
                       if isinstance(s, Source)}) or ["local data"]
    rows = "\n".join(f"| {i + 1} | {m['loss'][i]:.4f} [{m['loss_ci_low'][i]:.4f}, {m['loss_ci_high'][i]:.4f}] "
                     f"| {m['bits_per_byte'][i]:.4f} | {m['mean_kl_prev'][i]:.2e} | {m['frac_moving'][i]:.3f} |"
                     for i in (0, 1, 2, 3, 5, 7, 11, 15, 23, 31))
    shape = shape_of(meta["train_config"])
    return f"""# {name}: a looped LM trained on {' and '.join(datasets)} ({meta['n_params']:,} parameters)

Preset `{meta['preset']}` with overrides `{json.dumps(meta['overrides'])}`: d_model {shape['d_model']},
{shape['n_heads']} heads / {shape['n_kv_heads']} KV heads, FFN {shape['ffn_dim']}, prelude/core/coda
{shape['n_prelude']}/{shape['n_core']}/{shape['n_coda']} blocks, {tokenizer_sentence(meta)},
windows of {shape['max_seq_len']} tokens. Recipe: r̄ {recipe.r_bar:g}, r_max {recipe.r_max}, backprop depth
k {recipe.k}, σ {recipe.sigma:g}, {sampler_sentence(recipe)}. Where this model and its recipe
differ from the paper: [Deviations from the paper]({DEVIATIONS}).

{data_lines}
- **Training**: {meta['tokens_seen']:,} tokens ({meta['step']} steps{epochs_part(meta)}) in
  {meta['wall_seconds'] / 60:.0f} minutes on {machine}. {which_sentence(meta, source)}{validation_sentence(meta)}
- **Reproduce** (with the data files above where the command names them): `{command}`
- **Checkpoint id**: `{meta['checkpoint_id']}` (code revision {meta['code_revision']}).

## Measured on the {m['n_windows']} saved eval windows ({m['n_windows']} × {m['tokens_per_window']} tokens)

`python -m recur_core.report.export` measured these with `recur_core.analysis.trace` / `recur_core.analysis.curves` and the
settings of `recur_core/settings.py` (noise seed {SETTINGS.seed}, 95% bootstrap intervals over windows,
{SETTINGS.n_boot} replicates). {m['bytes_per_token']:.3f} bytes of text per token.

| loops | loss [nats/token] (95% CI) | bits/byte | mean KL(p_i ‖ p_i−1) [nats] | frac. moving (KL > {SETTINGS.moving_kl:g}) |
|---|---|---|---|---|
{rows}

- loss at r̄ = {rb}: **{m['loss'][rb - 1]:.4f} nats/token = {c['bits_per_byte_at_r_bar']:.3f} bits/byte**
- fall from 1 loop to r̄: **{c['drop_1_to_r_bar']:.4f} nats**; monotone (each step down or within 0.005): **{c['monotone_to_r_bar']}**
- loss at 32 loops minus loss at r̄: **{c['gap_32_vs_r_bar']:+.4f} nats**
- loss at 8 loops minus loss at 4 loops: **{c['loss_8_minus_loss_4']:+.4f} nats**
- mean KL at loop 2 / mean KL at loop 16: **{c['kl_ratio_2_over_16']:.3g}×**
- median convergence loop (KL stays ≤ 1e-3 from there on): {m['median_convergence_loop']:.1f}

{criteria_table(c, rb, m['loss'])}

{saturation}
## License

{license_text}
"""


def export(src: Path, dst: Path, command: str, machine: str, compare: Path | None = None) -> dict:
    """compare: a shipped checkpoint trained with another r̄, for the saturation section (for a
    checkpoint with ground truth, multi-hop programs, which gets its own card from
    hops_card.py: a hops checkpoint to set beside it)."""
    ckpt = load_checkpoint(src)
    task = task_of(ckpt.meta)
    if isinstance(task, HopsTask):
        return export_hops(src, dst, command, machine, compare)
    mixture = isinstance(task, WordProblems)
    meta = {**ckpt.meta, "vocab_size": ckpt.config.vocab_size}
    m = measure(src)
    rb = Recipe.from_meta(meta).depth
    c = checks(m, rb)
    saturation = ""
    if compare is not None:
        other = json.loads((compare / "card.json").read_text())["measured"]["loss"]
        other_rb = load_checkpoint(compare).recipe.depth
        saturation = saturation_section(dst.name, m["loss"], rb, compare.name, other, other_rb)
    if mixture:  # text mixed with word problems: its answers' ground truth ships, and a card section
        saturation += "\n" + mixture_section(src, task, CARD_LOOPS)

    def write(tmp: Path):
        for name in SHIPPED_FILES + ((GROUND_TRUTH,) if mixture else ()):
            shutil.copyfile(src / name, tmp / name)
        (tmp / "README.md").write_text(card(dst.name, meta, m, c, command, machine, saturation, src.name))
        (tmp / "card.json").write_text(json.dumps({"measured": m, "checks": c}, indent=2) + "\n")

    atomic_write_dir(dst, write)
    return c


def this_machine() -> str:
    """The default --machine line: CPU count and model, and whether it has AVX-512 (read from
    /proc/cpuinfo where there is one), so that a card never repeats another machine's claim."""
    import os
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{os.cpu_count()} CPU cores"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    simd = "AVX-512" if "avx512f" in info else "no AVX-512"
    return f"{os.cpu_count()} CPU cores ({model}, {simd})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--command", required=True, help="the exact training command, for the card")
    p.add_argument("--machine", default=None, help="the training machine, for the card (default: this one)")
    p.add_argument("--compare", type=Path, help="a shipped checkpoint trained with another r̄: adds the "
                                                "saturation-hypothesis section to the card (for a hops "
                                                "checkpoint: a hops checkpoint to set beside it)")
    args = p.parse_args(argv)
    machine = args.machine or this_machine()
    print(json.dumps(export(args.src, args.dst, args.command, machine, args.compare), indent=2))


if __name__ == "__main__":
    main()
