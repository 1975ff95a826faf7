"""The generated word problems (recur_core/tasks/stories.py and word_problems.py, trained by
training/word_problems.py): every answer is right (checked by an
independent solver that reads only the text), its steps label is where the answer word starts, the
stream is seeded and resumable, the mixture saves aligned ground truth, weights its training tokens
by label, and its curriculum holds each stage until it is learned and resumes exactly."""
import dataclasses
import random
import re

import pytest
import torch

from recur_core.tasks.stories import KINDS, NUMBER_WORDS, TOYS, guess_chance, token_steps, where_problem
from recur_core.tasks.word_problems import WordProblems, held_out_windows
from training.tokenizer import train_bpe
from training.word_problems import (
    TEXT_LABEL,
    Curriculum,
    MixedWindows,
    ProblemStream,
    interleave,
    mixture_data,
    tokenizer_sample,
)

TASK = WordProblems.parse("word_problems:max_steps=6")
NUM = {w: i for i, w in enumerate(NUMBER_WORDS)}


# -- an independent solver: reads a problem's text, returns every answer (word, steps) in order ----
def sentences(text: str) -> list[str]:
    return re.findall(r"[^.?]+[.?]", text)


def solve_count(text: str) -> list[tuple[str, int]]:
    owner, start = re.search(r"(\w+) had (\w+) \w+\.", text).groups()
    total, since_stated, out = NUM[start], 0, []
    for s in sentences(text)[1:]:
        if m := re.search(r" (\w+) (of them|more)\.", s):
            total += NUM[m.group(1)] if m.group(2) == "more" else -NUM[m.group(1)]
            since_stated += 1
        elif s.strip().startswith(("Now", f"{owner} had")):
            out.append((NUMBER_WORDS[total], since_stated))
            since_stated = 0
    return out


def where_answers(text: str) -> list[tuple[str, int]]:
    """Every answered place in order: after ", so" (1 step) and after a question (its links to the
    nearest child whose place was stated: at the place, or said to be there after a ", so")."""
    roots = dict(re.findall(r"(?:^|(?<=\. )|(?<=, ))(\w+) was at the (\w+)\.", text.split("Where was")[0]))
    parent = dict(re.findall(r"(\w+) was with (\w+)", text))
    resolved = set(roots) | set(re.findall(r"(\w+) was with \w+, so", text))
    out = []
    for m in re.finditer(r"(\w+) was with (\w+), so \w+ was at the (\w+)|Where was (\w+)\?", text):
        if m.group(4) is None:
            out.append((m.group(3), 1))
            continue
        who, links = m.group(4), 0
        while who not in resolved:
            who, links = parent[who], links + 1
        while who not in roots:
            who = parent[who]
        out.append((roots[who], links))
    return out


def solve_swap(text: str) -> list[tuple[str, int]]:
    has = dict(re.findall(r"(\w+) had a (\w+)", text))
    out, since_stated = [], 0
    for s in sentences(text):
        if m := re.search(r"(\w+) and (\w+) swapped", s):
            a, b = m.groups()
            has[a], has[b] = has[b], has[a]
            since_stated += 1
        elif m := re.search(r"Now (\w+) had the \w+ and (\w+) had", s):
            out += [(has[m.group(1)], 1), (has[m.group(2)], 1)]
            since_stated = 0
        elif m := re.search(r"^ ?(\w+) had the", s):
            out.append((has[m.group(1)], since_stated))
    return out


def solve_ages(text: str) -> list[tuple[str, int]]:
    first, age = re.search(r"(\w+) was (\w+) years old\.", text).groups()
    ages, out, since_stated = {first: NUM[age]}, [], 0
    for who, k, way, other, said in re.findall(r"(\w+) was (\w+) years? (older|younger) than (\w+)(, so)?", text):
        ages[who] = ages[other] + (NUM[k] if way == "older" else -NUM[k])
        since_stated += 1
        if said:
            out.append((NUMBER_WORDS[ages[who]], 1))
            since_stated = 0
    asked = re.search(r"How old was (\w+)\?", text).group(1)
    return out + [(NUMBER_WORDS[ages[asked]], since_stated)]


def solve_inside(text: str) -> list[tuple[str, int]]:
    """Every answered place in order: after ", so" (1 step) and after a question (its links to the
    nearest container whose place was stated: at the place, or said to be there after a ", so")."""
    story = text.split("Where was")[0]
    roots = dict(re.findall(r"(?:^|(?<=\. )|(?<=, ))[Tt]he (\w+) was at the (\w+)\.", story))
    parent = dict(re.findall(r"[Tt]he (\w+) was in the (\w+)", story))
    resolved = set(roots) | set(re.findall(r"(\w+) was in the \w+, so", story))
    out = []
    for m in re.finditer(r"(\w+) was in the \w+, so the \w+ was at the (\w+)|Where was the (\w+)\?", text):
        if m.group(3) is None:
            out.append((m.group(2), 1))
            continue
        item, links = m.group(3), 0
        while item not in resolved:
            item, links = parent[item], links + 1
        while item not in roots:
            item = parent[item]
        out.append((roots[item], links))
    return out


SOLVERS = {"count": solve_count, "where": where_answers, "swap": solve_swap, "ages": solve_ages,
           "inside": solve_inside}


@pytest.mark.parametrize("running", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_every_answer_is_what_the_text_implies(kind, running):
    rng = random.Random(7)
    for i in range(300):
        steps = 1 + i % 8
        p = TASK.problem(rng, steps, kind, running)
        labelled = [(j, s) for j, s in enumerate(p.steps) if s]
        solved = SOLVERS[kind](p.text)
        assert [s for _, s in labelled] == [s for _, s in solved], p.text
        for (pos, _), (word, _) in zip(labelled, solved, strict=True):
            assert p.text[pos:].startswith(word) and p.text[pos - 1] == " ", p.text
        if not running:  # the first question's answer needs the steps asked for
            assert labelled[0][1] == steps
        assert len(labelled) >= (1 if kind in ("count", "ages") else 2)


def test_inside_stories_name_each_container_once_and_ask_toys():
    rng = random.Random(2)
    for i in range(200):
        p = TASK.problem(rng, 1 + i % 8, "inside")
        story = p.text.split("Where was")[0]
        contained = re.findall(r"(?:^|(?<=\. )|(?<=, ))[Tt]he (\w+) was (?:in|at) the", story)
        assert len(contained) == len(set(contained)), p.text  # every item placed exactly once
        assert all(t in TOYS for t in re.findall(r"Where was the (\w+)\?", p.text))


def test_counts_and_ages_stay_number_words():
    rng = random.Random(3)
    for i in range(400):
        p = TASK.problem(rng, 1 + i % 8, ("count", "ages")[i % 2])
        numbers = re.findall(r"\b(?:zero|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|"
                             r"\w+teen|twenty|\d+)\b", p.text)
        assert numbers and all(w in NUM for w in numbers)
        assert all(p.text[j:].split()[0].strip(".") in NUM for j, s in enumerate(p.steps) if s)


def test_problems_are_seeded():
    a = [TASK.problem(random.Random(5), 3).text for _ in range(2)]
    assert a[0] == a[1]
    assert TASK.problem(random.Random(6), 3).text != a[0]


def test_parse_refuses_bad_settings():
    for bad in ("hops", "word_problems:share=1.5", "word_problems:kinds=count+sums", "word_problems:max_steps=0",
                "word_problems:depth=3", "word_problems:start_steps=7", "word_problems:advance_at=0",
                "word_problems:answer_weight=0", "word_problems:text_weight=-1"):
        with pytest.raises(ValueError):
            WordProblems.parse(bad)
    assert WordProblems.parse("word_problems:kinds=swap,share=0.25").kind_list == ["swap"]


@pytest.fixture(scope="module")
def tok():
    return train_bpe(tokenizer_sample(TASK, 0, n=1500), 400)


def test_token_steps_label_the_token_that_starts_the_answer(tok):
    rng = random.Random(11)
    for i in range(50):
        p = TASK.problem(rng, 1 + i % 6)
        enc = tok.encode(p.text)
        labels = token_steps(enc.offsets, p.steps)
        labelled = [(j, s) for j, s in enumerate(labels) if s]
        answers = [(pos, s) for pos, s in enumerate(p.steps) if s]
        assert [s for _, s in labelled] == [s for _, s in answers]
        for (t, _), (pos, _) in zip(labelled, answers, strict=True):
            start, end = enc.offsets[t]
            assert start <= pos < end
    with pytest.raises(ValueError, match="inside no token"):
        token_steps([(0, 2)], [0, 0, 0, 3])


def test_stream_windows_are_seeded_and_resume_exactly(tok):
    s = ProblemStream(TASK, tok, seed=0, window_len=65)
    first, first_steps = s.next_batch(3)
    assert first.shape == first_steps.shape == (3, 65)
    assert (first[:, 0] == tok.token_to_id("<|endoftext|>")).all() and first_steps.max() <= TASK.max_steps
    again = ProblemStream(TASK, tok, seed=0, window_len=65)
    again.load_state(s.state() | {"position": 1})
    assert torch.equal(again.next_batch(2)[0], first[1:])
    assert not torch.equal(ProblemStream(TASK, tok, seed=1, window_len=65).next_batch(1)[0][0], first[0])
    old = ProblemStream(TASK, tok, seed=0, window_len=65)
    old.load_state(2)  # a run saved before the curriculum: its state was the bare position
    assert torch.equal(old.next_batch(1)[0], first[2:])


class _Text:
    """A stand-in text source: rows counting up from 1000, so the mixed batch's order is visible."""

    def __init__(self, width=65):
        self.position, self.width = 0, width

    def next_batch(self, n):
        rows = torch.arange(self.position, self.position + n)[:, None].repeat(1, self.width) + 1000
        self.position += n
        return rows

    def state(self):
        return {"position": self.position}

    def load_state(self, state):
        self.position = state["position"]

    epoch = 0.0


QUARTER = dataclasses.replace(TASK, share=0.25)


def test_mixed_batches_alternate_at_the_share_and_resume(tok):
    mixed = MixedWindows(_Text(), ProblemStream(TASK, tok, 0, 65), QUARTER)
    batch = mixed.next_batch(8)
    is_text = (batch[:, 0] >= 1000).tolist()
    assert is_text == [True, False, True, False, True, True, True, True]
    state = mixed.state()
    after = mixed.next_batch(8)
    resumed = MixedWindows(_Text(), ProblemStream(TASK, tok, 0, 65), QUARTER)
    resumed.load_state(state)
    assert torch.equal(resumed.next_batch(8), after)


def test_interleave_keeps_the_rest_of_the_longer_set():
    a, b = torch.zeros(3, 2), torch.ones(1, 2)
    assert interleave(a, b)[:, 0].tolist() == [0, 1, 0, 0]


def test_mixture_data_aligns_ground_truth_with_the_windows(tok):
    text = torch.full((16, 65), 7)
    eval_ids, select_ids, probe_ids, batches, gt = mixture_data(TASK, tok, 0, 65, text, text[:8], text, _Text())
    steps = gt["ground_truth.safetensors"]["hops"]
    assert eval_ids.shape == steps.shape == (16, 65) and select_ids.shape == (8, 65)
    assert (steps[0::2] == 0).all() and (eval_ids[0::2] == 7).all()  # text windows: no answers
    problem_rows = eval_ids[1::2]
    assert (problem_rows[:, 0] == tok.token_to_id("<|endoftext|>")).all()
    assert steps[1::2].max() <= TASK.max_steps + TASK.extra_eval_steps and (steps[1::2] > 0).sum() >= 4
    # the held-out windows are not the training stream's, and not each other's
    train_rows = ProblemStream(TASK, tok, 0, 65).next_batch(8)[0]
    assert not any(torch.equal(r, t) for r in problem_rows for t in train_rows)
    ids, _ = held_out_windows(TASK, tok, 0, 2, 65, 10)
    assert not torch.equal(ids[0], ids[1])
    assert gt["ground_truth.safetensors"]["max_train_hops"].item() == TASK.max_steps
    assert isinstance(batches, MixedWindows)


WEIGHTED = WordProblems.parse("word_problems:share=0.5,answer_weight=1,other_weight=0.1,text_weight=0.3")


def test_loss_weights_follow_the_labels_of_this_ranks_rows(tok):
    mixed = MixedWindows(_Text(), ProblemStream(WEIGHTED, tok, 0, 65), WEIGHTED)
    batch = mixed.next_batch(4)
    for rows in (slice(None), slice(1, None, 2)):
        mine = batch[rows]
        w = mixed.loss_weights(mine[:, :-1], mine[:, 1:], rows)
        labels = mixed.labels[rows, 1:]
        assert w.shape == labels.shape
        assert (w[labels == TEXT_LABEL] == 0.3).all() and (labels == TEXT_LABEL).any() == (rows.step is None)
        assert (w[labels > 0] == 1.0).all() and (labels > 0).sum() >= 2
        assert torch.allclose(w[labels == 0], torch.tensor(0.1))
    with pytest.raises(ValueError, match="not the last batch's rows"):
        mixed.loss_weights(batch[:1, :-1], batch[:1, 1:], slice(None))


def test_curriculum_holds_a_stage_until_a_block_is_learned():
    c = Curriculum(top=2, max_steps=4, advance_at=0.8, block=100)
    c.record(79, 99)
    assert c.top == 2  # the block is not full yet
    c.record(0, 1)
    assert (c.top, c.seen) == (2, 0)  # 79 of 100: held, and the next block counts afresh
    c.record(60, 60)
    c.record(20, 40)
    assert (c.top, c.correct, c.seen) == (3, 0, 0)  # 80 of 100: moves on
    c.record(100, 100)
    c.record(100, 100)
    assert c.top == 4
    c.record(0, 100)
    assert (c.top, c.seen) == (4, 0)  # the last stage keeps no count
    again = Curriculum(top=2, max_steps=4, advance_at=0.8, block=100)
    again.load_state(Curriculum(3, 4, 0.8, 100, correct=5, seen=9).state())
    assert (again.top, again.correct, again.seen) == (3, 5, 9)


CURRICULUM = WordProblems.parse("word_problems:share=0.5,max_steps=4,start_steps=2,advance_at=0.5,advance_answers=8")


def test_curriculum_scores_top_answers_and_draws_up_to_its_top(tok):
    mixed = MixedWindows(_Text(129), ProblemStream(CURRICULUM, tok, 0, 129), CURRICULUM)
    assert mixed.has_curriculum and mixed.trained_hops == 2
    assert not MixedWindows(_Text(), ProblemStream(TASK, tok, 0, 65), TASK).has_curriculum
    for _ in range(3):
        batch = mixed.next_batch(16)
        assert mixed.labels.max() <= 2
    targets = batch[:, 1:]
    at_top = mixed.labels[:, 1:] == 2
    assert at_top.any()
    vocab = int(targets.max()) + 1
    perfect = torch.nn.functional.one_hot(targets, vocab).float()  # logits whose argmax is every target
    assert mixed.curriculum_counts(perfect, targets, slice(None)).tolist() == [at_top.sum().item()] * 2
    wrong = torch.nn.functional.one_hot((targets + 1) % vocab, vocab).float()
    assert mixed.curriculum_counts(wrong, targets, slice(None)).tolist() == [0, at_top.sum().item()]
    mixed.record(torch.tensor([0, 8]))
    assert mixed.trained_hops == 2  # a block at 0%: held
    mixed.record(torch.tensor([8, 8]))
    assert mixed.trained_hops == 3
    drawn = []
    for _ in range(6):
        mixed.next_batch(16)
        drawn.append(mixed.labels)
    assert torch.cat(drawn).max() == 3  # the new top is drawn, nothing above it
    state = mixed.state()
    after = mixed.next_batch(16), mixed.labels
    resumed = MixedWindows(_Text(129), ProblemStream(CURRICULUM, tok, 0, 129), CURRICULUM)
    resumed.load_state(state)
    assert resumed.trained_hops == 3
    assert torch.equal(resumed.next_batch(16), after[0]) and torch.equal(resumed.labels, after[1])


def test_guess_chance_counts_the_places_or_toys_told_before_each_answer():
    rng = random.Random(4)
    for kind in ("where", "inside", "swap"):
        for i in range(50):
            p = TASK.problem(rng, 1 + i % 5, kind, running=False)
            chance = guess_chance(p)
            n_candidates = 3 if kind == "swap" else len(set(re.findall(r"at the (\w+)\.", p.text.split("Where")[0])))
            assert chance == [1 / n_candidates] * len(p.answer_steps), p.text
    assert all(c != c for c in guess_chance(TASK.problem(rng, 2, "ages")))  # nan: no class to guess in


@pytest.mark.parametrize("kind", KINDS)
def test_recall_counts_facts_read_down_to_a_direct_recall(kind):
    """With recall every answer is labelled one more than its composition steps, and 1 step (no
    change, link or swap) asks a fact the story states."""
    task = WordProblems.parse(f"word_problems:recall=true,kinds={kind}")
    rng = random.Random(9)
    for i in range(200):
        steps = 1 + i % 6
        p = task.problem(rng, steps, running=i % 3 == 0)
        labelled = [s for s in p.steps if s]
        assert labelled == [s + 1 for _, s in SOLVERS[kind](p.text)], p.text
        if i % 3:
            assert labelled[0] == steps, p.text
    recall = task.problem(random.Random(1), 1, running=False)
    first = next(pos for pos, s in enumerate(recall.steps) if s)
    assert recall.steps[first] == 1
    word = recall.text[first:].split()[0].strip(".")
    assert recall.text.count(word) >= 2  # the answer was told before it is asked


@pytest.mark.parametrize("kind", KINDS)
def test_extra_facts_lengthen_a_story_and_keep_its_answers(kind):
    """extra_facts tells unasked facts about children the story does not name, before its first
    question: the same answers at the same steps (the text's own solver agrees), a longer text."""
    plain, extra = (WordProblems.parse(f"word_problems:kinds={kind},extra_facts={n}") for n in (0, 3))
    for i in range(100):
        steps, running = 1 + i % 8, i % 3 == 0
        base = plain.problem(random.Random(i), steps, running=running)
        p = extra.problem(random.Random(i), steps, running=running)
        facts = re.findall(r"(?:^|(?<=\. ))([A-Z][a-z]+) was at the (\w+)\. ", p.text)
        added = [name for name, _ in facts if name not in base.text]
        assert len(p.text) > len(base.text) and 1 <= len(added) <= 3, p.text
        assert p.text.index(added[0]) < p.text.index("?")
        labelled = [(j, s) for j, s in enumerate(p.steps) if s]
        assert [s for _, s in labelled] == [s for s in base.steps if s]
        solved = SOLVERS[kind](p.text)
        assert [s for _, s in labelled] == [s for _, s in solved], p.text
        for (pos, _), (word, _) in zip(labelled, solved, strict=True):
            assert p.text[pos:].startswith(word), p.text
    with pytest.raises(ValueError, match="extra_facts"):
        WordProblems.parse("word_problems:extra_facts=-1")


def test_bool_settings_parse_and_refuse():
    assert WordProblems.parse("word_problems:recall=1").recall is True
    assert WordProblems.parse("word_problems:recall=False").recall is False
    with pytest.raises(ValueError, match="recall"):
        WordProblems.parse("word_problems:recall=maybe")
    with pytest.raises(ValueError, match="max_steps"):
        WordProblems.parse("word_problems:max_steps=six")


def terse_answers(text: str) -> list[tuple[str, int]]:
    """An independent reading of a terse story: "A place." states where A was, "B A." that B was
    with A; each "X?" is answered by the place its chain reaches, and the links followed."""
    story, _, questions = text.partition("?")
    place_of, with_whom = {}, {}
    for first, second in re.findall(r"(\w+) (\w+)\.", text[:text.rfind(".", 0, len(story)) + 1]):
        (with_whom if second[0].isupper() else place_of)[first] = second
    out = []
    for asked in re.findall(r"(\w+)\?", text):
        who, links = asked, 0
        while who not in place_of:
            who, links = with_whom[who], links + 1
        out.append((place_of[who], links))
    return out


def test_terse_stories_chain_two_word_clauses_like_where_stories():
    """terse_share=1 tells every where story in two-word clauses: the answers (found by reading the
    clauses) sit where the labels are, label the links followed (+1 with recall), and the chains are
    where_problem's for the same RNG (its question asks where_problem's first question's child)."""
    for recall in (False, True):
        task = WordProblems.parse(f"word_problems:kinds=where,terse_share=1,recall={recall}")
        plain = WordProblems.parse(f"word_problems:kinds=where,recall={recall},running_share=0")
        for i in range(200):
            steps = 1 + i % 7
            p = task.problem(random.Random(i), steps)
            assert p.terse and " was " not in p.text and p.text.endswith("."), p.text
            assert p.text.count("?") == 1, p.text  # one question: no second answer to find by elimination
            labelled = [(j, s) for j, s in enumerate(p.steps) if s]
            solved = terse_answers(p.text)
            assert [s for _, s in labelled] == [s + recall for _, s in solved], p.text
            assert labelled[0][1] == steps
            for (pos, _), (word, _) in zip(labelled, solved, strict=True):
                assert p.text[pos:].startswith(word) and p.text[pos - 2:pos] == "? ", p.text
            sentences_ = plain.problem(random.Random(i), steps)  # draws `running` as terse draws its form
            assert solved[0] == where_answers(sentences_.text)[0]  # the same chains: the same first answer


def test_terse_share_mixes_forms_and_guessing_counts_told_places():
    task = WordProblems.parse("word_problems:kinds=where+swap,terse_share=0.5")
    rng = random.Random(3)
    problems = [task.problem(rng, 2) for _ in range(400)]
    terse = [p for p in problems if p.terse]
    assert all(p.kind == "where" for p in terse)
    assert 0.15 < len(terse) / len(problems) < 0.35  # half of the where half
    for p in terse:
        told = set(re.findall(r"\w+ ([a-z]+)\.", p.text.split("?")[0]))
        assert guess_chance(p) == [1 / len(told)] * len(p.answer_steps), p.text
    for bad in ("terse_share=1.5", "terse_share=-0.1", "kinds=swap,terse_share=0.5"):
        with pytest.raises(ValueError, match="terse_share"):
            WordProblems.parse(f"word_problems:{bad}")
    # no terse share: the stream draws what it drew before the option existed (the kind, running, the story)
    rng = random.Random(5)
    rng.choice(["where"])
    expected = where_problem(rng, 3, rng.random() < 0.5).text
    assert WordProblems.parse("word_problems:kinds=where").problem(random.Random(5), 3).text == expected


def test_a_problems_first_word_is_the_token_of_its_later_mentions(tok):
    """Problems are told after a space, so "Kate" opening a story and "Kate" later in it are one token
    (a byte-level BPE reads " Kate" and "Kate" apart), and the labels stay on the answers' tokens."""
    from recur_core.tasks.word_problems import encode_problem
    task = WordProblems.parse("word_problems:kinds=where,terse_share=1")
    for i in range(30):
        p = task.problem(random.Random(i), 2)
        ids, steps = encode_problem(tok, p)
        first = p.text.split()[0]
        assert ids[0] == tok.encode(" " + first, add_special_tokens=False).ids[0]
        assert ids.count(ids[0]) >= 2, p.text  # the opening child is asked or linked to later
        answers = [tok.decode([t]).strip() for t, s in zip(ids, steps, strict=True) if s]  # first pieces
        expected = [w for w, _ in terse_answers(p.text)]
        assert all(a and w.startswith(a) for a, w in zip(answers, expected, strict=True)), p.text


def test_a_terse_mixtures_example_texts_open_with_its_own_problems():
    terse = WordProblems.parse("word_problems:kinds=where,terse_share=1,recall=true").text_examples(None, None, 8)
    names = list(terse)  # its 3 problems, then the 4 prose examples that are not word problems
    assert len(terse) == 7 and names[0].startswith("Word problem") and "Story opening" in names
    problems = [text for name, text in terse.items() if name.startswith("Word problem")]
    assert len(problems) == 3 and all(" was " not in t and t.count("?") == 1 for t in problems)
    assert [links + 1 for links in (terse_answers(t)[0][1] for t in problems)] == [2, 3, 4]  # facts read
    plain = WordProblems.parse("word_problems").text_examples(None, None, 8)
    assert all(" was " in t for name, t in plain.items() if name.startswith("Word problem: who"))
