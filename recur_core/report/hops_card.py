"""The model card of a checkpoint trained on multi-hop programs (recur_core/tasks/hops.py), for export.py.

Every number is measured here with the product's own code (recur_core.analysis.trace, recur_core.analysis.probe,
recur_core.analysis.ground_truth) on the checkpoint's 128 held-out eval programs, and judged against the
goals of the multi-hop checkpoint (issue 10). Unmet goals are stated as such.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from recur_core.analysis.curves import json_safe
from recur_core.analysis.exact import ExactPath
from recur_core.analysis.ground_truth import (
    GROUND_TRUTH,
    Labels,
    eos_id,
    ground_truth_section,
    load_ground_truth,
    operating_point_families,
    operating_point_gaps,
    trained_answers,
)
from recur_core.analysis.probe import load_or_train_probes
from recur_core.analysis.stats import Bootstrap
from recur_core.analysis.trace import trace
from recur_core.model.checkpoint import SHIPPED_FILES, atomic_write_dir
from recur_core.model.config import shape_of
from recur_core.model.formats import load_checkpoint
from recur_core.settings import SETTINGS
from recur_core.tasks import task_of
from recur_core.tasks.hops import elimination_chance, trained_hops, window_hops

CARD_LOOPS = 32
TABLE_LOOPS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)


def measure(ckpt_dir: Path, n_boot: int = SETTINGS.n_boot, max_train: int | None = None) -> dict:
    """The ground_truth section (as in report.json: exact, what decoding gets) on all 128 eval
    programs, to CARD_LOOPS loops, with the fast path's section under "fast" and the per-policy gap
    under "fast_minus_exact" (max_train: the largest trained hop count, default the checkpoint's
    ground truth file's)."""
    ckpt = load_checkpoint(ckpt_dir)
    hops, saved_max_train = load_ground_truth(ckpt_dir)
    max_train = saved_max_train if max_train is None else max_train
    r_max, r_bar, seed = ckpt.recipe.r_max, round(ckpt.recipe.r_bar), SETTINGS.seed
    probe_windows = ckpt.windows("probe")[:SETTINGS.probe_windows]
    probes = load_or_train_probes(ckpt, r_max, seed, answers=trained_answers(window_hops(ckpt.tokenizer(),
                                  probe_windows).numpy(), max_train), cache=False, progress=True)
    windows = ckpt.windows("eval").numpy()
    tr = trace(ckpt, windows, max(CARD_LOOPS, r_max), seed=seed, probes=list(probes.values()), cache=False,
               progress=True)
    boot = Bootstrap(tr.n_windows, n_boot, seed)
    labels, loops = Labels(hops, max_train, eos_id(ckpt.tokenizer())), max(CARD_LOOPS, r_max)
    section = lambda exact: ground_truth_section(  # noqa: E731
        tr, labels, loops, r_bar, boot, operating_point_families(loops, probes), exact)
    exact, fast = section(ExactPath(ckpt, windows, progress=True)), section(None)
    tok = ckpt.tokenizer()
    texts = [tok.decode([i for i in w.tolist() if i != tok.token_to_id("<|endoftext|>")]) for w in ckpt.windows("eval")]
    exact["chance_accuracy"] = float(np.mean([c for t in texts for c in elimination_chance(t)]))
    exact["probes_refused"] = probes.refused
    exact["depth_mode"] = ckpt.recipe.depth_mode
    exact["fast"] = {k: v for k, v in fast.items() if k != "answers"}
    exact["fast_minus_exact"] = operating_point_gaps(fast, exact)
    return json_safe(exact)


def goals(gt: dict) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for the goals of issue 10 that are pass/fail, and for a checkpoint
    trained with per-token depth issue 27's first goal (≤ 0.4× the best uniform depth)."""
    acc = gt["uniform"]["accuracy_by_hops"]
    rb, H = gt["r_bar"], gt["max_train_hops"]
    trained = [h for h in gt["hop_counts"] if h <= H]
    at_rbar = {h: acc[str(h)][rb - 1] for h in trained}
    deep_at_1 = {h: acc[str(h)][0] for h in gt["hop_counts"] if 4 <= h <= H}
    a1 = gt["policies"]["A1"]["spearman_exit_vs_hops"]
    best = min(gt["policies"].items(), key=lambda kv: (not kv[1]["matches_a0_rbar"], kv[1]["mean_loops"]))
    ratio = best[1]["vs_best_uniform_loops_ratio"]
    best_line = (f"{best[0]}: {best[1]['mean_loops']:.2f} loops vs uniform {gt['best_uniform_depth']} "
                 f"({'n/a' if ratio is None else format(ratio, '.2f')}×)"
                 + ("" if best[1]["matches_a0_rbar"] else ", and it does not match A0@r̄"))

    def within(bound: float) -> bool:
        return bool(best[1]["matches_a0_rbar"] and ratio is not None and ratio <= bound)

    per_token = [("per-token depth: a policy matches A0@r̄ within 1 point with mean loops ≤ 0.4× the smallest "
                  "uniform depth reaching it", best_line, within(0.4))] if gt.get("depth_mode") == "per_token" else []
    return [
        (f"answer accuracy at r̄ = {rb} ≥ 95% for every hop count ≤ {H}",
         f"lowest {min(at_rbar.values()):.1%} (at {min(at_rbar, key=at_rbar.get)} hops)", min(at_rbar.values()) >= 0.95),
        ("answer accuracy at 1 loop ≤ 50% for hop counts ≥ 4",
         f"highest {max(deep_at_1.values()):.1%}" if deep_at_1 else "no such hop counts", bool(deep_at_1) and
         max(deep_at_1.values()) <= 0.5),
        ("Spearman(A1 exit depth, hop count) ≥ 0.7",
         "n/a" if a1["value"] is None else f"{a1['value']:.3f} [{a1['ci_low']:.3f}, {a1['ci_high']:.3f}]",
         a1["value"] is not None and a1["value"] >= 0.7),
        ("a policy matches A0@r̄ within 1 point with mean loops ≤ 0.5× the smallest uniform depth reaching it",
         best_line, within(0.5)),
        *per_token,
    ]


BESIDE_LOOPS = (1, 2, 3, 4, 6, 8)


def beside_section(name: str, gt: dict, other_name: str, other: dict, same_programs: bool) -> str:
    """The card's comparison with another hops checkpoint (its shipped card.json's ground truth):
    answer accuracy per hop count at uniform depths, and each policy's exact operating point."""
    programs = ("the same 128 eval programs" if same_programs else
                "**different** eval programs (the two tasks' generators differ), so compare with care")
    cols = [r for r in BESIDE_LOOPS if r <= min(gt["r_max"], other["r_max"])]
    rows = ["| hops | " + " | ".join(f"{r} loops" for r in cols) + " |", "|---|" + "---|" * len(cols)]
    acc, other_acc = gt["uniform"]["accuracy_by_hops"], other["uniform"]["accuracy_by_hops"]
    for h in gt["hop_counts"]:
        if str(h) in other_acc:
            mark = "" if h <= gt["max_train_hops"] else " (unseen)"
            rows.append(f"| {h}{mark} | " + " | ".join(
                f"{100 * acc[str(h)][r - 1]:.0f} / {100 * other_acc[str(h)][r - 1]:.0f}" for r in cols) + " |")
    pol = ["| policy | mean loops | × best uniform | Spearman(exit, hops) | answer acc. |", "|---|---|---|---|---|"]
    for pname, p in gt["policies"].items():
        q = other["policies"].get(pname)
        if q is None:
            continue
        pol.append(f"| {pname} | {p['mean_loops']:.2f} / {q['mean_loops']:.2f} | {_ratio(p)} / {_ratio(q)} | "
                   f"{_rho(p)} / {_rho(q)} | {100 * p['answer_accuracy']:.1f}% / {100 * q['answer_accuracy']:.1f}% |")
    return f"""## Beside `{other_name}`

Each cell: `{name}` / `{other_name}`, on {programs}. Best uniform depth (the smallest reaching A0@r̄'s
accuracy within 1 point on the trained hop counts): **{gt['best_uniform_depth']}** / **{other['best_uniform_depth']}**
loops; target accuracy {100 * gt['target_accuracy']:.1f}% / {100 * other['target_accuracy']:.1f}%.

Answer accuracy (%) at uniform depth:

{chr(10).join(rows)}

Exact operating points (as in the policy table above):

{chr(10).join(pol)}
"""


def card(name: str, meta: dict, gt: dict, command: str, machine: str, beside: str = "") -> str:
    tc, shape = meta["train_config"], shape_of(meta["train_config"])
    acc = gt["uniform"]["accuracy_by_hops"]
    loops = [r for r in TABLE_LOOPS if r <= gt["r_max"]]
    header = "| hops | answers | " + " | ".join(f"{r}" for r in loops) + " |"
    rows = [header, "|" + "---|" * (len(loops) + 2)]
    for h in gt["hop_counts"]:
        mark = "" if h <= gt["max_train_hops"] else " (unseen)"
        rows.append(f"| {h}{mark} | {gt['n_answers_by_hops'][str(h)]} | "
                    + " | ".join(f"{100 * acc[str(h)][r - 1]:.0f}" for r in loops) + " |")
    pol_rows = ["| policy | threshold | answer acc. | mean loops (all tokens) | vs A0@r̄ | vs best uniform "
                f"({gt['best_uniform_depth']}) | Spearman(exit, hops) [95% CI] | fast path: loops, acc., Spearman |",
                "|---|---|---|---|---|---|---|---|"]
    for pname, p in gt["policies"].items():
        sp, ratio, fast = p["spearman_exit_vs_hops"], p["vs_best_uniform_loops_ratio"], gt["fast"]["policies"][pname]
        fsp = fast["spearman_exit_vs_hops"]["value"]
        spt = "n/a" if sp["value"] is None else f"{sp['value']:.3f} [{sp['ci_low']:.3f}, {sp['ci_high']:.3f}]"
        pol_rows.append(f"| {pname} | {float(p['threshold']):.3g} | {100 * p['answer_accuracy']:.1f}% | {p['mean_loops']:.2f} | "
                        f"{p['vs_a0_rbar_loops_ratio']:.2f}× | {'n/a' if ratio is None else format(ratio, '.2f') + '×'} "
                        f"| {spt}{'' if p['matches_a0_rbar'] else ' (does not match A0@r̄)'} "
                        f"| {fast['mean_loops']:.2f}, {100 * fast['answer_accuracy']:.1f}%, "
                        f"{'n/a' if fsp is None else format(fsp, '.3f')} |")
    verdicts = goals(gt)
    goal_rows = ["| goal | measured | met |", "|---|---|---|"]
    goal_rows += [f"| {g} | {m} | {'yes' if ok else '**no**'} |" for g, m, ok in verdicts]
    n_met = sum(ok for _, _, ok in verdicts)
    chance = gt["chance_accuracy"]
    best_acc = max(gt["uniform"]["answer_accuracy"])
    status = (f"**Status: {n_met} of {len(verdicts)} goals met** (table at the end). Best answer accuracy at any "
              f"uniform depth: {100 * best_acc:.1f}%; no-lookup chance (one of the values not yet answered, "
              f"averaged over answers): {100 * chance:.1f}%.")
    if best_acc < chance + 0.1:
        status += (" **The model did not learn the lookups: it is at chance, so depth cannot matter and the "
                   "exit-depth figures below describe noise.** It is shipped as an honest pilot, so that the "
                   "Ground truth page and the analysis run on a real checkpoint; see docs/BENCHMARKS.md.")
    else:
        status += " " + learned_line(gt)
    extra = "\n".join(f"- {h} hops ({e['n_answers']} answers): {_pct_ci(e['accuracy_at_r_bar'])} at r̄, "
                      f"{_pct_ci(e['accuracy_at_r_max'])} at {gt['r_max']} loops, best {100 * e['best_accuracy']:.0f}% "
                      f"at {e['best_loops']} loops" for h, e in gt["extrapolation"].items())
    refused = "".join(f"\n- {why}" for why in gt.get("probes_refused", {}).values())
    return f"""# {name}: a looped LM trained on multi-hop variable-binding programs ({meta['n_params']:,} parameters)

Programs bind variables in independent chains ({meta['task']['chains']} queried, {meta['task']['decoys']} decoys that are
never queried) and then query one variable of each queried chain (`k=7;b=k;x=b;` … `x?7;`); an answer's
**hop count** (the lookups it needs) is its ground-truth depth (`recur_core/tasks/hops.py`).

{status}

Preset `{meta['preset']}` with overrides
`{json.dumps(meta['overrides'])}`: d_model {shape['d_model']}, {shape['n_heads']} heads / {shape['n_kv_heads']} KV
heads, FFN {shape['ffn_dim']}, prelude/core/coda {shape['n_prelude']}/{shape['n_core']}/{shape['n_coda']} blocks, a
{meta.get('vocab_size', '')}-token word vocabulary (a token per statement, query and answer), windows of {shape['max_seq_len']} tokens. Recipe:
{meta['recipe_text']}, lr {tc['lr']}. Where this recipe and the runtime differ from the paper:
[Deviations from the paper](../../docs/DEVIATIONS.md).

- **Data**: `{tc['dataset']}`, generated on the fly (seeded; no data files), trained on hop counts
  1..{gt['max_train_hops']}; the 128 eval programs are held out (another seed) and go to
  {max(gt['hop_counts'])} hops.
- **Training**: {meta['step']} steps ({meta['tokens_seen']:,} window tokens) in {meta['wall_seconds'] / 60:.0f}
  minutes on {machine}.{_init_line(meta)}
- **Reproduce**: `{command}`
- **Checkpoint id**: `{meta['checkpoint_id']}` (code revision {meta['code_revision']}).

## Answer accuracy (%) per hop count × uniform loops, on the 128 held-out programs

Measured by `python -m recur_core.report.export` with `recur_core.analysis.ground_truth` (noise seed 0); the same
numbers as the `ground_truth` section of `python -m recur_core.analyze`.

{chr(10).join(rows)}

## Exit policies against the hop counts (exact, each at its operating point)

Exact: what real decoding gets, a halted token staying in the context with its exit state. For
state-based rules (the latent rule, cosine, A2) the masking harness computes exactly what teacher-forced
decoding under the "recompute" KV rule does. Readout rules (A1, Huginn's KL / entropy / argmax) are
decoded: decoding's per-loop readout sees earlier tokens at their exit states, the harness at their
current loop, so their operating point is found by decoding the programs themselves, starting from the
harness's (`python -m bench.exact_vs_decoding` checks both against decoding). The fast path's figures
(each token read off the uniform trace at its exit loop, as if every other token had looped to full
depth) stand in the last column; they overstate the saving.

Operating point: the cheapest threshold whose answer accuracy on the trained hop counts
1..{gt['max_train_hops']} is within {100 * gt['tolerance']:.0f} point of A0 at r̄
(at least {100 * gt['target_accuracy']:.1f}%: A0@{gt['r_bar']} is at {100 * gt['uniform']['answer_accuracy'][gt['r_bar'] - 1]:.1f}%);
best uniform: the smallest uniform depth reaching that accuracy on the same answers
(**{gt['best_uniform_depth']}** loops). Mean loops are over every program token (answers are a few
percent of them); Spearman is over answer tokens, with a 95% bootstrap CI over programs.

{chr(10).join(pol_rows)}
{refused}

## Extrapolation past the trained hop counts

{extra or '- (no eval program goes past the trained hop counts)'}

{beside}
## Against the goals

{chr(10).join(goal_rows)}

## License

Weights, tokenizer and the generated programs are ours (no third-party data).
"""


def _init_line(meta: dict) -> str:
    """The card's line for a run that started from another checkpoint's weights (--init-from)."""
    init = meta.get("init_from")
    if not init:
        return ""
    return (f"\n- **Started from** `{init['path']}` (checkpoint `{init['checkpoint_id']}`, step {init.get('step')}, "
            f"trained with {init['recipe'].get('depth_mode', 'per_step').replace('_', '-')} depth): the steps above "
            "come on top of its training.")


def _ratio(policy: dict) -> str:
    x = policy["vs_best_uniform_loops_ratio"]
    return "n/a" if x is None else f"{x:.2f}×"


def _rho(policy: dict) -> str:
    x = policy["spearman_exit_vs_hops"]["value"]
    return "n/a" if x is None else f"{x:.3f}"


def _pct_ci(est: dict) -> str:
    return f"{100 * est['value']:.0f}% [{100 * est['ci_low']:.0f}, {100 * est['ci_high']:.0f}]"


def learned_line(gt: dict) -> str:
    """Which trained hop counts reach 90% answer accuracy at some uniform depth, and which do not."""
    best = {h: max(a for a in gt["uniform"]["accuracy_by_hops"][str(h)] if a is not None)
            for h in gt["hop_counts"] if h <= gt["max_train_hops"]}
    learned = [h for h, a in best.items() if a >= 0.9]
    if len(learned) == len(best):
        return "Every trained hop count reaches 90% answer accuracy at some uniform depth."
    rest = ", ".join(f"{h}: {100 * a:.0f}%" for h, a in best.items() if a < 0.9)
    return (f"**Hop counts learned (>= 90% at some uniform depth): {', '.join(map(str, learned)) or 'none'}**; "
            f"the others, with their best accuracy at any depth: {rest}.")


def trained_hops_of(src: Path, task, saved: int) -> int:
    """The largest hop count the run had trained on when src was saved, from its trainer state (the
    stream position); a checkpoint without one keeps its ground truth file's figure. (Trainers
    before this check saved the task's H even when a run stopped before its curriculum got there.)"""
    state = src / "trainer_state.json"
    if not state.is_file():
        return saved
    return min(saved, trained_hops(task, int(json.loads(state.read_text())["data"]["position"])))


def export_hops(src: Path, dst: Path, command: str, machine: str, compare: Path | None = None) -> dict:
    """Ship a multi-hop checkpoint: its files plus the ground truth, with the card measured here;
    compare: a shipped hops checkpoint to set beside it (from its card.json)."""
    ckpt = load_checkpoint(src)
    task = task_of(ckpt.meta)
    meta = {**ckpt.meta, "vocab_size": ckpt.config.vocab_size, "task": {"chains": task.chains, "decoys": task.decoys},
            "recipe_text": ckpt.recipe.describe()}
    hops, saved_max_train = load_ground_truth(src)
    max_train = trained_hops_of(src, task, saved_max_train)
    gt = measure(src, max_train=max_train)
    verdicts = [{"goal": g, "measured": m, "met": ok} for g, m, ok in goals(gt)]
    summary = {k: v for k, v in gt.items() if k != "answers"}
    beside = ""
    if compare is not None:
        other = json.loads((compare / "card.json").read_text())["ground_truth"]
        same = torch.equal(ckpt.windows("eval"), load_checkpoint(compare).windows("eval"))
        beside = beside_section(dst.name, gt, compare.name, other, same)

    def write(tmp: Path):
        for name in SHIPPED_FILES:
            shutil.copyfile(src / name, tmp / name)
        save_file({"hops": torch.from_numpy(hops), "probe_hops": window_hops(ckpt.tokenizer(), ckpt.windows("probe")),
                   "max_train_hops": torch.tensor([max_train])}, str(tmp / GROUND_TRUTH))
        (tmp / "README.md").write_text(card(dst.name, meta, gt, command, machine, beside))
        (tmp / "card.json").write_text(json.dumps({"ground_truth": summary, "goals": verdicts}, indent=2) + "\n")

    atomic_write_dir(dst, write)
    return {"goals": verdicts}
