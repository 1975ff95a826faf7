"""The multi-hop program task: hop counts on hand-written programs, the generator, the tokenizer,
and exact resume of a run trained on the generated stream."""
import random

import pytest
import torch
from tiny import make_tiny_hops_checkpoint

from recur_core import load_checkpoint
from recur_core.analysis.ground_truth import load_ground_truth
from recur_core.model.checkpoint import read_safetensors
from recur_core.tasks.hops import (
    HopsTask,
    build_tokenizer,
    elimination_chance,
    eval_program,
    hop_counts,
    make_program,
    program_ids,
    random_program,
    token_hops,
    trained_hops,
    training_program,
)
from training.hops import HopsStream, structured_embedding, training_data


def answers(text: str) -> dict[str, int]:
    """{queried variable: hop count} read off hop_counts (the answer sits 2 characters after it)."""
    h = hop_counts(text)
    return {text[i - 2]: h[i] for i in range(len(text)) if h[i]}


def test_hop_counts_on_hand_written_programs():
    assert answers("k=7;b=k;x=b;m=3;q=x;q?7;b?7;m?3;") == {"q": 4, "b": 2, "m": 1}
    # interleaved chains; a variable bound to a deeper one is one more hop
    assert answers("a=1;c=2;d=c;b=a;e=d;f=e;f?2;b?1;") == {"f": 4, "b": 2}
    # only the answer position carries the count; other tokens carry 0
    h = hop_counts("a=1;b=a;b?1;")
    assert h == [0] * 10 + [2, 0]
    # an unbound variable (or one bound to an unbound one) has no ground truth
    assert answers("a=z;a?3;x?1;") == {}


def test_generated_programs_have_distinct_values_and_the_asked_hop_counts():
    rng = random.Random(3)
    for _ in range(200):
        hops = [rng.randint(1, 10) for _ in range(2)]
        p = make_program(rng, hops, max_tail=2, decoy_hops=[rng.randint(1, 6) for _ in range(2)])
        assert p.hops == hop_counts(p.text)
        assert sorted(h for h in p.hops if h) == sorted(hops)
        answers = [p.text[i] for i, h in enumerate(p.hops) if h]
        literals = [s[2] for s in p.text.split(";") if len(s) == 3 and s[1] == "=" and s[2].isdigit()]
        assert len(literals) == 4 and len(set(literals)) == 4  # 2 queried chains + 2 decoys, distinct values
        assert len(set(answers)) == 2 and set(answers) < set(literals)  # no answer follows by elimination
        bound = [s[0] for s in p.text.split(";") if len(s) == 3 and s[1] == "="]
        assert len(bound) == len(set(bound))  # each variable bound once


def test_eval_programs_reach_past_training_and_the_curriculum_grows():
    task = HopsTask(max_hops=6, extra_eval_hops=4, start_hops=2, programs_per_level=10)
    assert max(max(eval_program(task, 0, i).hops) for i in range(20)) == 10
    assert task.curriculum_hops(0) == 2 and task.curriculum_hops(25) == 4 and task.curriculum_hops(10 ** 6) == 6
    early = [max(training_program(task, 0, i).hops) for i in range(10)]
    assert max(early) <= 2
    assert training_program(task, 5, 7).text == training_program(task, 5, 7).text  # seeded
    warm = HopsTask(recall_programs=5, recall_pairs=8, start_hops=2, programs_per_level=10)
    recall = training_program(warm, 0, 4)
    assert [h for h in recall.hops if h] == [1] * 6 and recall.text.count("=") == 8
    assert warm.curriculum_hops(0) == 2 and max(training_program(warm, 0, 5).hops) <= 2  # then the curriculum
    assert training_program(task, 5, 7).text != training_program(task, 6, 7).text
    # what a run stopped after n programs has trained on (the card's H)
    assert [trained_hops(task, n) for n in (0, 1, 10, 11, 25, 10 ** 7)] == [0, 2, 2, 3, 4, 6]
    assert [trained_hops(warm, n) for n in (5, 6, 16)] == [1, 2, 3]


def test_elimination_chance():
    # 3 literal values; the first answer has 3 candidates, the second 2 (one value already answered)
    assert elimination_chance("a=1;b=2;c=3;d=a;d?1;b?2;") == [1 / 3, 1 / 2]


def test_tokenizer_has_one_token_per_statement_and_round_trips():
    tok = build_tokenizer()
    text = "k=7;b=k;b?7;"
    enc = tok.encode(text)
    assert enc.tokens == ["k=7;", "b=k;", "b?", "7;"] and tok.decode(enc.ids) == text
    assert tok.token_to_id("<|endoftext|>") == 0
    # anything else is single characters; characters outside the vocabulary become EOS (unknown)
    assert tok.encode("k = 7;x?").tokens == ["k", "<|endoftext|>", "=", "<|endoftext|>", "7;", "x?"]


def test_statement_tokens_start_from_shared_codes():
    tok = build_tokenizer()
    emb = structured_embedding(tok, 10, seed=0)
    row = lambda word: emb[tok.token_to_id(word)]
    assert torch.equal(row("x=b;")[5:], row("b=7;")[:5])  # what x is bound to: b's code
    assert torch.equal(row("x?")[5:], row("y=x;")[5:])  # a query points at x like a binding to x does
    assert torch.equal(row("x=7;")[5:], row("K=7;")[5:]) and not torch.equal(row("x=7;")[5:], row("x=8;")[5:])
    assert not row("x?")[:5].any()
    assert torch.equal(emb, structured_embedding(tok, 10, seed=0))  # seeded


def test_every_program_the_app_can_ask_for_fits_the_variables():
    task = HopsTask()
    for max_hops in range(1, task.max_hops + task.extra_eval_hops + 1):
        for seed in range(20):
            p = random_program(task, seed, max_hops)
            assert max(p.hops) == max_hops and sum(1 for h in p.hops if h) == task.chains


def test_token_hops_put_each_answer_count_on_its_token():
    ids, hops = token_hops(build_tokenizer(), "k=7;b=k;x=b;x?7;k?7;")
    assert len(ids) == len(hops) == 1 + 7  # EOS, 3 statements, 2 queries and their 2 answers
    tokens = [build_tokenizer().id_to_token(i) for i in ids]
    assert [(t, h) for t, h in zip(tokens, hops, strict=True) if h] == [("7;", 3), ("7;", 1)]
    assert tokens[hops.index(3) - 1] == "x?"  # the answer is predicted at its query token
    with pytest.raises(ValueError, match="does not fit"):
        program_ids(build_tokenizer(), make_program(random.Random(0), [6, 6], 0), window_len=8)


def test_stream_position_is_its_state_and_loss_weights_favour_answers():
    task, tok = HopsTask(), build_tokenizer()
    a = HopsStream(task, tok, seed=1, window_len=65)
    a.next_batch(5)
    b = HopsStream(task, tok, seed=1, window_len=65)
    b.load_state(a.state())
    batch = a.next_batch(4)
    assert torch.equal(batch, b.next_batch(4))
    w = a.loss_weights(batch[:, :-1], batch[:, 1:], slice(None))
    is_answer = torch.tensor([[tok.id_to_token(i).endswith("?") for i in row] for row in batch[:, :-1].tolist()])
    assert is_answer.sum() == 4 * task.chains  # one answer per queried chain
    assert (w[is_answer] == task.answer_weight).all() and (w[~is_answer] < task.answer_weight).all()


def test_bad_hops_setting_is_a_clear_error():
    with pytest.raises(ValueError, match="hops setting"):
        HopsTask.parse("hops:nope=3")
    with pytest.raises(ValueError, match="do not fit"):
        HopsTask.parse("hops:max_hops=12,chains=6")


def test_stopped_and_resumed_hops_run_equals_uninterrupted_run(tmp_path):
    straight = make_tiny_hops_checkpoint(tmp_path / "a", steps=16)
    stopped = make_tiny_hops_checkpoint(tmp_path / "b", steps=16, trainer_kwargs={"stop_at_step": 7})
    assert load_ground_truth(stopped)[1] == 1  # 56 programs: the curriculum (64 a level) is still at 1 hop
    resumed = make_tiny_hops_checkpoint(tmp_path / "b", steps=16, trainer_kwargs={"resume": True})
    a, b = read_safetensors(straight / "model.safetensors"), read_safetensors(resumed / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    state = load_checkpoint(resumed).meta
    assert state["step"] == 16
    hops, max_train = load_ground_truth(resumed)
    assert max_train == 2 and hops.max() == 4  # 128 programs: 2 hops so far; eval programs go to H + 1
    assert hops.shape == tuple(load_checkpoint(resumed).windows("eval").shape)


def test_best_is_selected_on_held_out_programs_disjoint_from_the_eval_ones():
    tok = build_tokenizer()
    eval_ids, select_ids, _, _, gt = training_data(HopsTask.parse("hops"), tok, seed=0, window_len=65, n_select=8)
    assert eval_ids.shape == (128, 65) and select_ids.shape == (8, 65)
    assert gt  # the eval programs carry their hop counts
    assert not any(torch.equal(s, e) for s in select_ids for e in eval_ids)
