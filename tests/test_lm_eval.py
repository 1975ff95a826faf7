"""The lm-eval model `recur` and the local tasks (recur_eval/): offline simple_evaluate on a tiny hops
checkpoint, per-sample log-likelihoods against the project's own teacher-forced scoring, the shared
runs, the shipped task data. lm-eval is the [eval] extra: in CI (CI set) it must be installed; elsewhere
these tests skip with that reason."""
import json
import os
import random

import numpy as np
import pytest
import torch

if os.environ.get("CI"):
    import lm_eval  # noqa: F401
else:
    pytest.importorskip("lm_eval", reason="lm-eval is the [eval] extra: pip install -e '.[dev]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import recur_eval  # noqa: E402,F401  (registers "recur")
from recur_core import load_checkpoint  # noqa: E402
from recur_core.decoding.teacher_forced import teacher_forced  # noqa: E402
from recur_eval.model import RecurLM, make_policy  # noqa: E402
from recur_eval.scoring import group_runs  # noqa: E402
from recur_eval.task_data import DATA_FILES, TASKS_DIR, hops_qa_docs, read_jsonl, write_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def tiny_task(hops_ckpt, tmp_path_factory):
    """A 10-document hops_qa over the tiny checkpoint's own eval programs, as a task folder."""
    folder = tmp_path_factory.mktemp("tasks")
    docs = hops_qa_docs(hops_ckpt)[:10]
    write_jsonl(docs, folder / "tiny_hops.jsonl")
    yaml = (TASKS_DIR / "hops_qa.yaml").read_text().replace("task: hops_qa", "task: tiny_hops_qa")
    yaml += f"dataset_kwargs:\n  data_file: {folder / 'tiny_hops.jsonl'}\n"
    (folder / "tiny_hops_qa.yaml").write_text(yaml)
    return folder, docs


def test_hops_qa_docs_rebuild_the_eval_windows(hops_ckpt):
    """Every document is an answer of the eval windows: its context + gold answer are the window's tokens."""
    ckpt = load_checkpoint(hops_ckpt)
    tok, windows = ckpt.tokenizer(), ckpt.windows("eval")
    docs = hops_qa_docs(hops_ckpt)
    assert docs and all(d["hops"] >= 1 for d in docs)
    for d in docs[:40]:
        ids = tok.encode(d["context"] + f"{d['gold']};", add_special_tokens=False).ids
        assert ids == windows[d["program"], 1:d["position"] + 1].tolist()


def test_simple_evaluate_offline_reports_acc_and_mean_loops(hops_ckpt, tiny_task, monkeypatch):
    from lm_eval import simple_evaluate

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, docs = tiny_task
    out = simple_evaluate(model="recur", model_args=f"pretrained={hops_ckpt},policy=a1,threshold=0.05",
                          tasks=["tiny_hops_qa"], task_manager=TaskManager(include_path=str(folder)),
                          batch_size=4, log_samples=True)
    res = out["results"]["tiny_hops_qa"]
    samples = out["samples"]["tiny_hops_qa"]
    assert len(samples) == 10
    # acc is the share of documents whose best choice is the gold one, from the logged log-likelihoods
    acc = np.mean([int(np.argmax([r[0] for r in s["filtered_resps"]])) == s["doc"]["gold"] for s in samples])
    assert res["acc,none"] == pytest.approx(acc)
    recur = out["config"]["recur"]
    assert recur["scored_tokens"]["tiny_hops_qa"] == 10 * 10  # 10 documents x 10 one-token choices
    assert 1 <= res["mean_loops,none"] <= recur["max_loops"]
    assert res["mean_loops,none"] == pytest.approx(recur["mean_loops"]["tiny_hops_qa"])
    assert 1 <= recur["mean_loops_run"]["tiny_hops_qa"] <= recur["max_loops"]


@pytest.mark.parametrize("policy,args", [("a1", dict(threshold=1e-3)), ("latent", dict(threshold=0.01)),
                                         ("uniform", dict(loops=2))])
def test_loglikelihoods_equal_teacher_forced_scoring(hops_ckpt, policy, args):
    """Per request, lm-eval's log-likelihood, greedy flag and exit loops are what teacher_forced gives
    for that sequence alone (batch 1, noise row 0), although recur shares runs and batches them."""
    lm = RecurLM(pretrained=str(hops_ckpt), policy=policy, batch_size=3, kv_rule="recompute", **args)
    docs = hops_qa_docs(hops_ckpt)[:8]
    choices = ["0;", "3;", "7;"]
    reqs = [Instance("loglikelihood", d, (d["context"], c), idx=i, metadata=("t", n, 1))
            for n, d in enumerate(docs) for i, c in enumerate(choices)]
    cut = docs[0]["context"].index(";", 10) + 1
    reqs.append(Instance("loglikelihood", docs[0], (docs[0]["context"][:cut], docs[0]["context"][cut:]), idx=0,
                         metadata=("t", 99, 1)))  # a multi-token continuation
    results = lm.loglikelihood(reqs, disable_tqdm=True)
    policy_obj = make_policy(lm.ckpt, policy, args.get("threshold"), args.get("loops"))
    exits_seen = set()
    for req, res in zip(reqs, results, strict=True):
        ctx, cont = lm._encode_pair(*req.args)
        seq = torch.tensor([[lm.eos] + ctx + cont])
        tf = teacher_forced(lm.ckpt, seq, policy_obj, "recompute", batch_size=1, noise_rows=[0], keep_logits=True)
        scored = slice(seq.shape[1] - 1 - len(cont), seq.shape[1] - 1)
        assert res[0] == pytest.approx(-float(tf.ce[0, scored].double().sum()), abs=1e-4)
        assert res[1] == bool((tf.logits[0, scored].argmax(-1) == torch.tensor(cont)).all())
        assert res.loops == tuple(tf.exit_loop[0, scored].tolist())
        exits_seen.update(res.loops)
    info = lm.get_model_info()["recur"]
    if policy == "uniform":
        assert exits_seen == {2} and info["mean_loops_run"]["t"] == 2
    # the runs: one per distinct input that extends no other, each position counted once
    inputs = {tuple([lm.eos] + sum(lm._encode_pair(*r.args), [])[:-1]) for r in reqs}
    assert info["run_tokens"]["t"] == sum(len(x) for x in inputs if not any(o != x and o[:len(x)] == x for o in inputs))
    if policy == "latent":  # on this tiny model A1 halts nearly every token at one loop; the latent rule does not
        assert len(exits_seen) > 1, "the policy should halt tokens at different loops here"


def test_group_runs_reads_every_input_off_an_extension():
    rng = random.Random(0)
    inputs = [tuple(rng.randint(0, 2) for _ in range(rng.randint(1, 5))) for _ in range(300)]
    runs, run_of = group_runs(inputs)
    assert len(set(runs)) == len(runs)
    for seq, r in zip(inputs, run_of, strict=True):
        assert runs[r][:len(seq)] == seq
    for r in runs:  # runs are maximal: no run is a prefix of another
        assert not any(o != r and o[:len(r)] == r for o in runs)


def test_generate_until_stops_at_until(hops_ckpt):
    lm = RecurLM(pretrained=str(hops_ckpt), policy="uniform", loops=2)
    context = hops_qa_docs(hops_ckpt)[0]["context"]
    req = Instance("generate_until", {}, (context, {"until": [";"], "max_gen_toks": 6}), idx=0,
                   metadata=("t", 0, 1))
    out = lm.generate_until([req], disable_tqdm=True)
    assert len(out) == 1 and ";" not in out[0]
    assert lm.loops_by_task["t"] and set(lm.loops_by_task["t"]) == {2}


def test_loglikelihood_rolling_sums_the_windows(hops_ckpt):
    lm = RecurLM(pretrained=str(hops_ckpt), policy="uniform", loops=2)
    text = hops_qa_docs(hops_ckpt)[0]["context"]
    [total] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), idx=0,
                                                 metadata=("t", 0, 1))], disable_tqdm=True)
    ids = lm.tok_encode(text)
    tf = teacher_forced(lm.ckpt, torch.tensor([[lm.eos] + ids]), make_policy(lm.ckpt, "uniform", loops=2),
                        batch_size=1, noise_rows=[0])
    assert total == pytest.approx(-float(tf.ce.double().sum()), abs=1e-4)


def test_bad_model_args_are_refused(hops_ckpt):
    with pytest.raises(ValueError, match="policy"):
        RecurLM(pretrained=str(hops_ckpt), policy="nope")
    with pytest.raises(ValueError, match="loops"):
        RecurLM(pretrained=str(hops_ckpt), policy="a1", loops=3)
    with pytest.raises(ValueError, match="unknown model_args"):
        RecurLM(pretrained=str(hops_ckpt), polciy="a1")


def test_shipped_task_data_is_well_formed():
    hops = read_jsonl(DATA_FILES["hops_qa"])
    assert len(hops) == 768 and {d["hops"] for d in hops} == set(range(1, 11))
    assert all(d["context"].endswith("?") and 0 <= d["gold"] <= 9 for d in hops)
    cloze = read_jsonl(DATA_FILES["tinystories_cloze"])
    assert len(cloze) == 200
    for d in cloze:
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4 and 0 <= d["gold"] < 4
        assert all(c.startswith(" ") and c[1:].isalpha() for c in d["choices"])
    json.dumps(cloze)  # plain JSON types
