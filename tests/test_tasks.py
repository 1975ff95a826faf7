"""recur_core.tasks: one Task interface, told from a checkpoint's spec in one place, behind which hops
programs, word problems and prose read texts and label examples."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from recur_core.tasks import EOS, HopsTask, Prose, WordProblems, parse_task, task_of
from recur_core.tasks.hops import build_tokenizer, eval_windows, hop_counts


def word_tokenizer(texts: list[str]) -> Tokenizer:
    """A whitespace word-level tokenizer over the words of `texts` (EOS token 0)."""
    words = sorted({w for t in texts for w, _ in pre_tokenizers.WhitespaceSplit().pre_tokenize_str(t)})
    tok = Tokenizer(models.WordLevel({EOS: 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_task_of_tells_the_task_from_the_spec():
    assert task_of({"train_config": {"dataset": "hops:max_hops=4,chains=4"}}) == HopsTask(max_hops=4, chains=4)
    mixture = {"train_config": {"dataset": "roneneldan/TinyStories", "mixture": "word_problems:max_steps=3"}}
    assert task_of(mixture) == WordProblems(max_steps=3)
    assert task_of({"train_config": {"dataset": "roneneldan/TinyStories", "mixture": ""}}) == Prose()
    assert task_of({}) == Prose()  # Huginn / Ouro folders: no training config
    assert parse_task("hops", "word_problems") == HopsTask()  # the dataset decides first, as the trainer reads it
    with pytest.raises(ValueError, match="hops setting"):
        parse_task("hops:depth=3")
    with pytest.raises(ValueError, match="word_problems kinds"):
        parse_task("text", "word_problems:kinds=poems")


def test_units_nouns_and_ground_truth():
    assert [(t.kind, t.unit, t.noun, t.has_ground_truth) for t in (HopsTask(), WordProblems(), Prose())] == [
        ("hops", "hop", "program", True), ("word_problems", "step", "problem", True), ("prose", None, "text", False)]
    assert [t.padding for t in (HopsTask(), WordProblems(), Prose())] == [EOS, None, None]  # only programs are padded
    with pytest.raises(ValueError, match="prose task has no ground truth"):
        Prose().random_example(0, 3)


def test_a_hops_program_is_read_with_its_hop_counts():
    tok = build_tokenizer()
    tokens = HopsTask().read(tok, "k=7;b=k;b?7;")
    assert tokens.ids[0] == tok.token_to_id(EOS) and tokens.pieces == ("␄", "k=7;", "b=k;", "b?", "7;")
    assert tokens.depths == (0, 0, 0, 0, 2)
    example = HopsTask().random_example(seed=3, deepest=5)
    assert example.deepest == 5 and list(example.char_depths) == hop_counts(example.text)
    assert HopsTask().labelled(tok, example).depths == HopsTask().read(tok, example.text).depths


def test_hops_examples_come_from_the_eval_windows():
    task, tok = HopsTask(), build_tokenizer()
    windows, hops = eval_windows(task, tok, seed=0, n=4, window_len=80)
    examples = task.eval_examples(tok, windows, seed=0, n=3)
    assert len(examples) == 3
    for ex, window_hops in zip(examples, hops, strict=False):
        assert sorted(h for h in task.read(tok, ex.text).depths if h) == sorted(h for h in window_hops.tolist() if h)
    named = task.text_examples(tok, windows, 2)
    assert list(named.values()) == [ex.text for ex in examples[:2]]
    assert all(name.startswith(f"#{i} · deepest answer") for i, name in enumerate(named))
    assert [p[-1] for p in task.prompts(tok, windows, 2)] == ["?", "?"]  # up to the first query
    assert task.text_examples(tok, None, 8) == Prose().text_examples(None, None, 8)  # no eval windows: prose


def test_word_problems_label_their_answer_tokens_and_read_text_as_prose():
    task = WordProblems()
    example = task.random_example(seed=1, deepest=3)
    assert example.deepest == 3
    tok = word_tokenizer([example.text])
    tokens = task.labelled(tok, example)
    assert tokens.ids[0] == 0 and tokens.pieces[0] == "␄"
    answers = [(p, d) for p, d in zip(tokens.pieces, tokens.depths, strict=True) if d]
    words = example.text.split()
    assert [d for _, d in answers] == [d for d in example.char_depths if d]
    assert all(p.strip(".,?") in {w.strip(".,?") for w in words} for p, _ in answers)
    pasted = task.read(tok, example.text)  # as trained: EOS, a space, the problem; its answers unlabelled
    assert pasted.ids == tokens.ids and pasted.pieces == tokens.pieces and set(pasted.depths) == {0}
    held_out = task.eval_examples(tok, None, seed=0, n=8)
    assert [ex.deepest for ex in held_out] == [ex.deepest for ex in task.eval_examples(tok, None, seed=0, n=8)]
    assert {ex.deepest for ex in held_out} == set(range(1, task.max_steps + task.extra_eval_steps + 1))


def test_a_word_problem_checkpoint_reads_a_story_after_eos_and_a_problem_after_eos_and_a_space():
    tok = Tokenizer.from_file(str(Path(__file__).parents[1] / "checkpoints" / "specimen" / "tokenizer.json"))
    task, eos = WordProblems(), tok.token_to_id(EOS)
    problem = task.read(tok, "Ben zoo. Amy Ben. Amy? zoo.")
    assert problem.ids[0] == eos and problem.pieces[:2] == ("␄", " Ben")
    assert problem.ids[1] == problem.ids[problem.pieces.index(" Ben", 2)]  # the first name is its later mentions' token
    story = task.read(tok, "Once upon a time, there was a cat.")
    assert story.ids == (eos, *tok.encode("Once upon a time, there was a cat.").ids)
    assert story.pieces[1] == "Once" and set(story.depths) == {0}


def test_prose_reads_plain_text_and_offers_examples():
    tok = word_tokenizer(["the cat sat"])
    tokens = Prose().read(tok, "the cat sat")
    assert tokens.pieces == ("the", "cat", "sat") and tokens.depths == (0, 0, 0)
    examples = Prose().text_examples(None, None, 8)
    assert len(examples) == 8 and next(iter(examples)).startswith("Word problem")
    assert Prose().prompts(None, None, 2) == ["Once upon a time, there was a little girl named Lily.",
                                              "Tom had a red ball."]


def test_held_out_windows_carry_their_depths():
    tok = build_tokenizer()
    ids, depths = HopsTask().ground_truth_windows(tok, seed=0, n=3, window_len=80)
    assert ids.shape == depths.shape == (3, 80) and int(depths.max()) >= 1
    assert torch.equal(ids, eval_windows(HopsTask(), tok, 0, 3, 80)[0])
    with pytest.raises(ValueError, match="no ground truth"):
        Prose().ground_truth_windows(tok, 0, 3, 80)
