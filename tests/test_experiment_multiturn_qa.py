"""experiment_multiturn_qa/train.py: search calls, the action mask of scripted multi-turn episodes, the reward
terms, learning to search with a tiny model, two steps end to end, and bad input.

The shared tests (test_experiments_grpo_math.py) check the GRPO pieces of this file too; test_experiments_rewards, test_experiments_bad_input,
test_experiments_learning and test_experiments_end_to_end do not run for it (it is in conftest.MULTI_TURN): their counterparts are here.
"""

from types import SimpleNamespace

import pytest
import torch

import conftest
from conftest import (ROOT, fails_with, help_text, load_experiment, load_tiny, on_most_seeds, rose, run_script, teach,
                      tensorboard_scalars, write_jsonl, write_pdf)
import tiny_grpo.decode

NAME = "experiment_multiturn_qa"
SCRIPT = ROOT / NAME / "train.py"


@pytest.fixture(scope="module")
def qa():
    return load_experiment(NAME)


@pytest.fixture
def tiny_qa(qa, tiny_model_dir):
    """(module, model, tokenizer): the tiny model, float32, loaded by the experiment's own load_model."""
    module, model, tokenizer = load_tiny(qa, tiny_model_dir)
    model.eval()
    return module, model, tokenizer


@pytest.fixture
def corpus(tmp_path):
    """A three-document corpus whose passages are short; the first question's answer is in one of them."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "brio.md").write_text("# Brio\n\nBrio is a town in Miogriarary. It was first recorded in 927 and "
                                    "grew around a ferry crossing.\n")
    (folder / "yeiv.md").write_text("# Yeiv\n\nYeiv has a population of 3342 and is known for its orchards and "
                                    "its apple fair.\n")
    (folder / "notes.txt").write_text("The Zaill Institute was founded in 1790 by Mira Tosk, a botanist who "
                                      "collected pressed flowers.\n")
    return folder


# ---------------------------------------------------------------- parsing the model's search calls

@pytest.mark.parametrize("turn, query", [
    ("<search>birthplace of Grepeirk Gaepouv</search>", "birthplace of Grepeirk Gaepouv"),
    ("I should look this up. <search> Brio region </search>", "Brio region"),  # text before the call is free
    ("<search>unclosed query", None),  # an unclosed call is no call
    ("no call at all </search>", None),
    ("<search>first</search> and <search>second</search>", "second"),  # several calls: the last one runs
    ("<answer>Brio</answer><search>after the answer</search>", None),  # the episode ended at </answer>
    ("<search>outer <search>inner</search>", "inner"),  # nested: the innermost call runs
    ("<search></search>", ""),  # an empty query is a search that finds nothing
])
def test_find_search_call(qa, turn, query):
    assert qa.find_search_call(turn) == query


# ---------------------------------------------------------------- reward terms on hand-made strings

def test_normalisation_and_token_f1(qa):
    assert qa.normalize_answer("  The Zaill   Institute. ") == "zaill institute"
    assert qa.normalize_answer("33,422") == "33422" and qa.normalize_answer("An apple!") == "apple"
    assert qa.normalize_answer("Theodora") == "theodora"  # articles only as whole words
    assert qa.token_f1("x b c", "b c d") == pytest.approx(2 / 3)  # P = 2/3, R = 2/3
    assert qa.token_f1("a b c", "b c d") == pytest.approx(0.8)  # the article 'a' is dropped: P = 1, R = 2/3
    assert qa.token_f1("x y", "b c") == 0.0 and qa.token_f1("", "b") == 0.0


@pytest.mark.parametrize("completion, answer, expected", [
    ("<answer>The Zaill Institute.</answer>", "Zaill Institute", 1.0),  # exact after normalisation
    ("<answer> 33,422 </answer>", "33422", 1.0),
    ("<answer>bonmere</answer>", "Bonmere", 1.0),
    ("<answer>Sitrox</answer>", "Sitrox Veibyvrom", 0.5 * 2 / 3),  # P 1, R 1/2: F1 2/3, half credit
    ("<answer>born in Bonmere</answer>", "Bonmere", 0.5 * 0.5),  # P 1/3, R 1: F1 1/2
    ("<answer>Dakeindale</answer>", "Bonmere", 0.0),
    ("<answer>wrong</answer> then <answer>Bonmere</answer>", "Bonmere", 1.0),  # the last answer counts
    ("Bonmere", "Bonmere", 0.0),  # no answer tags
    ("<answer> the </answer>", "the", 0.0),  # empty after normalisation: no credit
])
def test_correctness(qa, completion, answer, expected):
    assert qa.correctness(completion, answer) == pytest.approx(expected)


@pytest.mark.parametrize("completion, expected", [
    ("<search>q</search><answer>Bonmere</answer>", 1.0),
    ("<answer> Bonmere </answer>\n", 1.0),  # no search is allowed
    ("Let me look. <search>a</search> Not yet. <search>b</search> Found it. <answer>Bonmere</answer>", 1.0),
    ("<answer></answer>", 0.0),  # empty answer
    ("<answer> a </answer>", 0.0),  # empty after normalisation
    ("<search>q<answer>Bonmere</answer>", 0.0),  # unclosed search
    ("<search>a <search>b</search><answer>Bonmere</answer>", 0.0),  # nested search
    ("<search> </search><answer>Bonmere</answer>", 0.0),  # empty search
    ("<answer>Bonmere</answer> and more", 0.0),  # the answer does not end the episode
    ("<answer>x</answer><answer>Bonmere</answer>", 0.0),  # two answers
    ("<information>Bonmere</information><answer>Bonmere</answer>", 0.0),  # the model wrote the tool's tags
    ("<search>q</search>", 0.0),  # no answer
])
def test_format_score(qa, completion, expected):
    assert qa.format_score(completion) == expected


def test_search_cost_and_weighted_sum(qa):
    assert [qa.search_cost({"searches": n}) for n in range(4)] == [0.0, 0.0, 0.5, 1.0]  # default --max-turns 3
    assert qa.search_cost({"searches": 3}, max_turns=5) == 0.5 and qa.search_cost({"searches": 1}, max_turns=1) == 0.0
    assert qa.search_cost({}) == 0.0  # no record: no search
    good = "<search>q</search><search>r</search><answer>Bonmere</answer>"
    found = {"searches": 2, "answer_retrieved": True}
    # correctness 1 + format 0 x 1 + retrieval 0.2 - 0.1 * (one extra search of two allowed)
    assert qa.Scorer()([good], ["Bonmere"], [found])[0].item() == pytest.approx(1 + 0.2 - 0.1 * 0.5)
    expensive = qa.Scorer("search_cost=-1,format=0,retrieval=0")
    assert expensive([good], ["Bonmere"], [{"searches": 3, "answer_retrieved": True}])[0].item() == pytest.approx(1 - 1)
    rewards, terms = qa.Scorer(max_turns=3)([good, "<answer>x</answer>", "<search>q</search>"], ["Bonmere"] * 3,
                                            [found, {"searches": 0}, {"searches": 1, "answer_retrieved": True}])
    assert set(terms) == {"correctness", "format", "retrieval", "search_cost"}
    assert terms["retrieval"].tolist() == [1.0, 0.0, 1.0] and terms["search_cost"].tolist() == [0.5, 0.0, 0.0]
    # a search that found the answer, without an answer yet, earns more than a well-formed guess without one
    assert torch.allclose(rewards, torch.tensor([1.15, 0.0, 0.2])) and terms["format"].tolist() == [1.0, 1.0, 0.0]
    assert qa.Scorer("format=0.1")([good], ["Bonmere"], [found])[0].item() == pytest.approx(1.25)


def test_retrieval_recall_matches_whole_words(qa):
    assert qa.answer_in("Grepeirk Gaepouv was born in 1817 in the town of Bonmere.", "bonmere")
    assert qa.answer_in("It has 33,422 people.", "33422") and qa.answer_in("Founded by Mira Tosk.", "Mira Tosk")
    assert not qa.answer_in("born in 18170", "1817") and not qa.answer_in("Tosk and Mira", "Mira Tosk")


# ---------------------------------------------------------------- the worked examples of the prompt

def test_worked_examples_are_true_episodes(qa):
    """Each example searches its question, reads one passage that holds the answer, and answers it: its own words
    (the passages left out, as the rollout scores them) earn full correctness and format; the passage is laid out
    as format_passages lays out the corpus's; and no name of the examples occurs in data/qa, so an answer copied
    from an example is never right there."""
    corpus_text = " ".join(path.read_text() for path in (ROOT / "data" / "qa").rglob("*.*") if path.is_file())
    for question, episode in qa.EXAMPLES:
        call, rest = episode.split("</search>", 1)
        assert qa.find_search_call(call + "</search>") == question  # the question itself is the query
        information, answer = rest.split("</information>", 1)
        passage = information.split("<information>\n", 1)[1]
        assert passage.startswith("Doc 1 (") and passage.count("Doc ") == 1  # one passage, the rollout's layout
        reference = qa.extract_answer(answer)
        assert qa.answer_in(passage, reference)  # the answer is read out of the passage
        words = call + "</search>" + answer  # the model's own words
        assert qa.reward_terms(words, reference, {"searches": 1})["correctness"] == 1.0
        assert qa.format_score(words) == 1.0
        for name in (reference, question.rstrip("?").split()[-2] + " " + question.rstrip("?").split()[-1]):
            assert name not in corpus_text, name


def test_prompt_plays_both_examples_then_the_question(qa, tiny_model_dir):
    plain = qa.format_prompt(SimpleNamespace(chat_template=None), "Who employed Brio Tosk?")
    dialogue = "".join(f"\nUser: {q}\nAssistant: {episode}" for q, episode in qa.EXAMPLES)
    assert plain == f"{qa.system_prompt()}{dialogue}\nUser: Who employed Brio Tosk?\nAssistant:"
    _, _, tokenizer = load_tiny(qa, tiny_model_dir)  # a chat template: the examples as earlier turns
    chat = qa.format_prompt(tokenizer, "Who employed Brio Tosk?")
    places = [chat.index(text) for q, episode in qa.EXAMPLES for text in (q, episode)] + [chat.index("Brio Tosk")]
    assert places == sorted(places)


def test_top_k_and_temperature_depend_on_the_device(qa):
    args = qa.parse_args(["--device", "cpu"])
    assert (args.top_k, args.temperature) == (1, 0.7)  # the 270M model reads the last passage it is shown
    args = qa.parse_args(["--device", "cpu", "--top-k", "3", "--temperature", "1"])
    assert (args.top_k, args.temperature) == (3, 1.0)
    assert qa.DEVICE_DEFAULTS["top_k"][0] == 3 and qa.DEVICE_DEFAULTS["temperature"][0] == 1.0  # CUDA


def test_eval_accuracy_counts_exact_answers_only(qa, monkeypatch):
    """F1 credit is a training signal; the held-out accuracy is the share of exact answers."""
    terms = {"correctness": torch.tensor([1.0, 0.25, 0.5, 0.0]), "format": torch.ones(4)}
    played = SimpleNamespace(terms=terms, searches=torch.ones(4), answer_retrieved=torch.ones(4))
    monkeypatch.setattr(qa, "rollout", lambda *a, **k: played)
    args = SimpleNamespace(max_length=8, generation_batch_size=4, max_turns=3, quantization="none", sampling_weights="auto",
                           plain=False)
    model = torch.nn.Linear(1, 1)
    assert qa.evaluate(model, None, [], args, None, None)[0]["eval/accuracy"] == 0.25
    # data/qa's rows say their kind ("hops"): the accuracy of each kind is reported beside the whole
    tasks = [{"metadata": {"hops": 1}}, {"metadata": {"hops": 2}}, {"metadata": {"hops": 1}}, {"metadata": {"hops": 2}}]
    metrics = qa.evaluate(model, None, tasks, args, None, None)[0]
    assert (metrics["eval/accuracy_hops_1"], metrics["eval/accuracy_hops_2"]) == (0.5, 0.0)  # rows 0, 2 and 1, 3
    played.terms["correctness"] = torch.tensor([1.0, 1.0, 0.0, 0.5])
    metrics = qa.evaluate(model, None, tasks, args, None, None)[0]
    assert (metrics["eval/accuracy"], metrics["eval/accuracy_hops_1"], metrics["eval/accuracy_hops_2"]) == (0.5, 0.5, 0.5)
    played.terms["correctness"] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert qa.evaluate(model, None, tasks, args, None, None)[0]["eval/accuracy_hops_1"] == 1.0


# ---------------------------------------------------------------- the dense search tool as the rollout uses it

def test_dense_search_tool_cuts_passages(qa, corpus, tmp_path):
    index = qa.SearchIndex(corpus, "dense", cache_dir=tmp_path / "cache")
    found = qa.make_search(index, top_k=2, passage_chars=40)(["Who founded the Zaill Institute?", "  "])
    assert len(found[0]) == 2 and found[1] == []  # top_k passages; an empty query finds nothing
    best = found[0][0]
    assert best.id == "notes#0" and best.text == "The Zaill Institute was founded in 1790 ..."  # cut at a space
    assert all(len(p.text) <= 40 + 4 for p in found[0])
    assert qa.shorten("short", 40) == "short" and qa.shorten("x" * 50, 0) == "x" * 50  # 0: whole passages


# ---------------------------------------------------------------- scripted episodes through the real sampling loop

class FakeSearch:
    """Records every batched call; each query finds one passage, 'text about QUERY'."""

    def __init__(self):
        self.calls = []

    def __call__(self, queries):
        self.calls.append(list(queries))
        return [[SimpleNamespace(id=f"doc-{q}", text=f"text about {q}")] for q in queries]


def script_turns(monkeypatch, qa, tokenizer, turns):
    """Replace sample_token with a typist: turns[k] lists the text of each episode still running in turn k.
    Rows that have finished get filler, which sample() replaces by padding. Records each call's logits."""
    steps, seen = [], []
    for rows in turns:
        ids = [tokenizer(text, add_special_tokens=False).input_ids for text in rows]
        width = max(map(len, ids))
        filler = tokenizer.convert_tokens_to_ids("z")
        steps += [torch.tensor([row[t] if t < len(row) else filler for row in ids]) for t in range(width)]
    steps = iter(steps)

    def typist(logits, temperature, top_p, uniforms=None):
        seen.append(logits.clone())
        step = next(steps)
        assert step.shape[0] == logits.shape[0], "the batch holds exactly the episodes still running"
        return step.clone()

    monkeypatch.setattr(qa, "sample_token", typist)
    monkeypatch.setattr(tiny_grpo.decode, "ENDED_SHARE", 2.0)  # every row of a turn to its end: the script gives each one a token
    return seen


def test_two_search_episode_mask_token_by_token(tiny_qa, monkeypatch):
    qa, model, tokenizer = tiny_qa
    search = FakeSearch()
    seen = script_turns(monkeypatch, qa, tokenizer, [
        # turn 1: two prompts x two episodes; rows 0 and 1 belong to the first prompt, rows 2 and 3 to the second
        ["<search>ab</search>", "<search>c</search>", "<answer>x</answer>", "<search>e</search>"],
        ["<search>d</search>", "<answer>c</answer>", "<answer>e</answer>"],  # turn 2: the three that searched
        ["<answer>ab</answer>"],  # turn 3: the one that searched twice
    ])
    tasks = [{"prompt": qa.format_prompt(tokenizer, q), "answer": a, "metadata": {}}
             for q, a in [("Where is Brio?", "ab"), ("Who founded the Zaill Institute?", "e")]]
    result = qa.rollout(model, tokenizer, tasks, group_size=2, max_length=60, search=search, max_turns=3)

    assert search.calls == [["ab", "c", "e"], ["d"]]  # one batched search per turn, for every paused episode
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    info = lambda q: ids(qa.INFORMATION.format(f"Doc 1 (doc-{q}):\ntext about {q}"))  # noqa: E731
    expected = [  # (tokens, 1 where the model chose them) per episode
        [(ids("<search>ab</search>"), 1), (info("ab"), 0), (ids("<search>d</search>"), 1), (info("d"), 0),
         (ids("<answer>ab</answer>"), 1)],
        [(ids("<search>c</search>"), 1), (info("c"), 0), (ids("<answer>c</answer>"), 1)],
        [(ids("<answer>x</answer>"), 1)],
        [(ids("<search>e</search>"), 1), (info("e"), 0), (ids("<answer>e</answer>"), 1)],
    ]
    prompt_width = result.sequence_ids.shape[1] - result.action_mask.shape[1]
    for row, parts in enumerate(expected):
        episode = [t for tokens, _ in parts for t in tokens]
        actions = [a for tokens, a in parts for _ in tokens]
        pad = result.action_mask.shape[1] - len(episode)
        assert result.sequence_ids[row, prompt_width:].tolist() == episode + [tokenizer.pad_token_id] * pad
        assert result.action_mask[row].tolist() == actions + [0] * pad
        assert result.attention_mask[row, prompt_width:].tolist() == [1] * len(episode) + [0] * pad
    assert result.completions == ["<search>ab</search><search>d</search><answer>ab</answer>",
                                  "<search>c</search><answer>c</answer>", "<answer>x</answer>",
                                  "<search>e</search><answer>e</answer>"]
    assert result.transcripts[1] == tokenizer.decode(expected[1][0][0] + info("c") + ids("<answer>c</answer>"))
    assert result.searches.tolist() == [2, 1, 0, 1] and result.turns.tolist() == [3, 2, 1, 2]
    assert result.answer_retrieved.tolist() == [1.0, 0.0, 0.0, 1.0]  # 'text about ab' holds the answer 'ab'
    assert result.information_tokens.tolist() == [len(info("ab")) + len(info("d")), len(info("c")), 0, len(info("e"))]
    assert result.terms["correctness"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert result.terms["format"].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert result.terms["search_cost"].tolist() == [0.5, 0.0, 0.0, 0.0]
    assert result.terms["retrieval"].tolist() == result.answer_retrieved.tolist()  # the search record's own verdict

    # Turn 2 is one left-padded batch of contexts of different lengths and prompts: each was seen as if alone.
    turn_2_first = seen[len(ids("<search>ab</search>"))]
    for batch_row, row, turn in [(1, 1, "<search>c</search>"), (2, 3, "<search>e</search>")]:
        real = result.attention_mask[row, :prompt_width].bool()
        context = result.sequence_ids[row, :prompt_width][real].tolist() + ids(turn) + info(turn[8:-9])
        alone = model(input_ids=torch.tensor([context])).logits[0, -1]
        assert torch.allclose(turn_2_first[batch_row], alone, atol=1e-4)

    # Log-probs come from the action positions only, and equal the full log-softmax there.
    log_probs, _ = qa.sequence_log_probs(model, result.sequence_ids, result.attention_mask,
                                         result.action_mask.shape[1], action_mask=result.action_mask)
    logits = model(input_ids=result.sequence_ids, attention_mask=result.attention_mask,
                   position_ids=(result.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits
    naive = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, result.sequence_ids[:, 1:, None]).squeeze(-1)
    naive = naive[:, -result.action_mask.shape[1]:]
    actions = result.action_mask.bool()
    assert torch.allclose(log_probs[actions], naive[actions], atol=1e-5) and (log_probs[~actions] == 0).all()


@pytest.mark.parametrize("max_turns, max_length, searches", [
    (1, 60, 1),  # the second call is past --max-turns: it is not run, and the episode ends there
    (3, 19, 0),  # the first call closes exactly at the budget: no token left to read the passages, so it is not run
    (0, 60, 0),  # --max-turns 0: no search at all
])
def test_searches_stop_at_max_turns_and_budget(tiny_qa, monkeypatch, max_turns, max_length, searches):
    qa, model, tokenizer = tiny_qa
    search = FakeSearch()
    script_turns(monkeypatch, qa, tokenizer, [["<search>ab</search>"], ["<search>d</search>"], ["<answer>ab</answer>"]])
    task = {"prompt": qa.format_prompt(tokenizer, "Where is Brio?"), "answer": "ab", "metadata": {}}
    result = qa.rollout(model, tokenizer, [task], group_size=1, max_length=max_length, search=search,
                        max_turns=max_turns)
    assert result.searches.tolist() == [searches] and search.calls == [["ab"]] * searches
    information = len(tokenizer(qa.INFORMATION.format("Doc 1 (doc-ab):\ntext about ab")).input_ids)
    expected = [1] * 19 + ([0] * information + [1] * 18 if searches else [])  # each call is 19 or 18 characters
    assert result.action_mask[0].tolist() == expected and result.turns.tolist() == [1 + searches]
    assert result.completions[0].endswith("</search>") and result.terms["search_cost"].item() == 0.0


# ---------------------------------------------------------------- learning: the tiny model learns to search

def learns_to_search(completion, answer, metadata=None, max_turns=3):
    """Half for opening a search, half for a search that ran: about 0.03 for the untrained model."""
    opened = 0.5 * ("<search>" in completion)
    return {"correctness": opened + 0.5 * min(1, metadata["searches"]), "format": 0.0, "retrieval": 0.0,
            "search_cost": 0.0}


@pytest.fixture(scope="module")
def tiny_search_model_dir(tmp_path_factory):
    """The conftest tiny model whose tokenizer also has <search> and </search> as single tokens: spelling them
    character by character is out of reach of an untrained model."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conftest, "TAGS", conftest.TAGS + ["<search>", "</search>"])
        return conftest.build_tiny_model(tmp_path_factory.mktemp("tiny-search"))


def test_grpo_learns_to_search(qa, tiny_search_model_dir, corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(qa, "reward_terms", learns_to_search)
    # A short prompt without the worked example: the tiny model's tokens are characters, so this is much faster.
    monkeypatch.setattr(qa, "format_prompt", lambda tokenizer, question: tokenizer.apply_chat_template(
        [{"role": "system", "content": "Look things up with <search> </search>."}, {"role": "user", "content": question}],
        tokenize=False, add_generation_prompt=True))
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": f"Where is Brio {i}?", "answer": "Miogriarary"}
                                              for i in range(32)])

    def learn(seed):
        runs = tmp_path / f"runs{seed}"
        qa.main([
            "--model-name", str(tiny_search_model_dir), "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", str(data), "--corpus-dir", str(corpus), "--retriever", "bm25", "--max-turns", "1",
            "--max-steps", "30", "--group-size", "8", "--rollouts-per-step", "4", "--max-length", "12", "--lr", "1e-2",
            "--kl-weight", "0.01", "--seed", str(seed), "--eval-interval", "0", "--checkpoint-interval", "0",
            "--log-completions-interval", "0", "--log-dir", str(runs), "--checkpoint-path", str(tmp_path / f"out{seed}"),
            "--run-name", "learn",
        ])
        scalars = tensorboard_scalars(runs)
        searches = [value for _, value in sorted(scalars["rollout/searches_per_episode"])]
        rewards = [value for _, value in sorted(scalars["rollout/reward_mean"])]
        information = [value for _, value in sorted(scalars["rollout/information_tokens"])]
        assert len(searches) == 30
        assert all(tokens > 0 for tokens, searched in zip(information, searches) if searched)  # the passages were in
        why = rose(searches) and f"searches {rose(searches)}"  # the episodes of every step that searched
        return why or (None if sum(rewards[-5:]) / 5 > 0.75 else f"reward {[round(r, 2) for r in rewards]}")

    # Five seeds: on the AMD EPYC without AVX-512 seed 1 learned to search and lost it again by step 22, and seed 3
    # learned to open a search but never to close one (a reward of 0.5); seeds 2, 4 and 5 learned
    on_most_seeds(learn, seeds=(1, 2, 3, 4, 5))


# ---------------------------------------------------------------- end to end, as a user runs it

LOGGED = {
    "rollout/reward_mean", "rollout/reward_correctness", "rollout/reward_format", "rollout/reward_search_cost",
    "rollout/reward_retrieval",
    "rollout/accuracy", "rollout/format_rate", "rollout/completion_length", "rollout/searches_per_episode",
    "rollout/turns_per_episode", "rollout/retrieval_recall", "rollout/information_tokens", "train/loss", "train/kl",
    "train/grad_norm", "perf/search_seconds", "perf/tokens_per_second", "eval/accuracy", "eval/format_rate",
    "eval/searches_per_episode", "eval/retrieval_recall",
}


E2E_ROWS = [{"question": f"Who built the ferry of Brio? ({i})", "answer": "Orrin Quade", "hops": 1} for i in range(6)]


@pytest.fixture(scope="module")
def searcher_model_dir(qa, tiny_search_model_dir, tmp_path_factory):
    """The tiny search model after 100 supervised steps on the turn '<search>Brio</search>' (its prompts show the user's
    turn only): it searches from the first step, in 4-bit too, as a pretrained model that has seen the format would."""
    def examples(step):
        return [(row["question"], "<search>Brio</search>") for row in E2E_ROWS]

    return teach(qa, tiny_search_model_dir, tmp_path_factory.mktemp("tiny-searcher"), examples, steps=100)


def test_two_steps_end_to_end(searcher_model_dir, corpus, tmp_path):
    """A fresh process as a user starts it, in 4-bit with LoRA, over a --corpus-dir of markdown, text and a PDF: the
    answer is only in the PDF, so a retrieval recall above 0 shows its text was indexed and shown to the model."""
    write_pdf(corpus / "ferries.pdf", [["The ferry of Brio was built by Orrin Quade in 1931."]])
    data = write_jsonl(tmp_path / "q.jsonl", E2E_ROWS)
    result = run_script(SCRIPT, "--model-name", searcher_model_dir, "--device", "cpu", "--quantization", "4bit",
                        "--dtype", "float32", "--data-path", data, "--eval-data-path", data, "--eval-prompts", 2,
                        "--corpus-dir", corpus, "--retriever", "bm25", "--top-k", 2, "--max-turns", 2,
                        "--group-size", 4, "--rollouts-per-step", 2, "--max-length", 12, "--max-steps", 2,
                        "--eval-interval", 1, "--log-completions-interval", 1, "--lr", "1e-2", "--run-name", "e2e",
                        "--log-dir", tmp_path / "runs", "--checkpoint-path", tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bm25 index of 4 passages" in result.stdout  # brio.md, yeiv.md, notes.txt and the PDF's page
    scalars = tensorboard_scalars(tmp_path / "runs" / "e2e")
    assert LOGGED <= set(scalars), f"missing tags: {LOGGED - set(scalars)}"
    assert sorted(step for step, _ in scalars["train/loss"]) == [1, 2]
    assert sorted(step for step, _ in scalars["eval/accuracy"]) == [0, 1, 2]
    for tag in ("rollout/searches_per_episode", "rollout/information_tokens", "rollout/retrieval_recall"):
        assert all(value > 0 for _, value in scalars[tag]), (tag, scalars[tag])  # searched, and found the PDF
    assert all(value > 1 for _, value in scalars["rollout/turns_per_episode"])  # passages, then another turn
    checkpoint = tmp_path / "out" / "e2e" / "step_000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "training_state.pt").is_file()


def test_help_lists_the_search_options(qa):
    text = " ".join(help_text(NAME).split())  # on a wide terminal: no wrapping inside a default
    for option in ["--corpus-dir", "--retriever {dense,bm25}", "--top-k", "--passage-chars", "--max-turns",
                   "--reward-weights", "--kl-weight", "--resume", "--eval-interval"]:
        assert option in text, option
    for default in ["(default: data/qa/corpus)", "(default: dense)", "(default: 3 on CUDA, 1 on CPU)", "(default: 1.0 on CUDA, 0.7 on CPU)", "(default: 300)",
                    "correctness=1,format=0,retrieval=0.2,search_cost=-0.1", "(default: data/qa/questions.jsonl)"]:
        assert default in text, default


# ---------------------------------------------------------------- bad input: one line, before the model loads

def test_missing_or_empty_corpus_dir(qa, tmp_path, capsys):
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "Where is Brio?", "answer": "Miogriarary"}])
    argv = ["--device", "cpu", "--model-name", "not-loaded", "--data-path", data, "--eval-interval", "0",
            "--retriever", "bm25"]
    message = fails_with(qa, argv + ["--corpus-dir", tmp_path / "missing"], capsys)
    assert message.strip() == f"error: --corpus-dir {tmp_path / 'missing'}: corpus folder not found: {tmp_path / 'missing'}"
    (tmp_path / "empty").mkdir()
    message = fails_with(qa, argv + ["--corpus-dir", tmp_path / "empty"], capsys)
    assert "no .md, .txt, .pdf files in corpus folder" in message and "\n" not in message.strip()


@pytest.mark.parametrize("argv, expected", [
    (["--retriever", "tfidf"], "argument --retriever: invalid choice: 'tfidf'"),
    (["--top-k", "0"], "argument --top-k: must be an integer in [1, inf), got 0"),
    (["--max-turns", "-1"], "argument --max-turns: must be an integer in [0, inf), got -1"),
    (["--passage-chars", "-5"], "argument --passage-chars: must be an integer in [0, inf), got -5"),
    (["--reward-weights", "reasoning=1"], "unknown reward term 'reasoning'"),
])
def test_bad_option_values(qa, capsys, argv, expected):
    assert expected in fails_with(qa, argv, capsys)


# -- Nothing lost, round three (issue 59)


def test_top_k_is_bounded_by_what_fits_the_context(qa, tiny_model_dir, tmp_path, capsys, monkeypatch):
    """--top-k was bounded by the corpus only, and check_context counted the prompt and --max-length but not the
    passages: an episode of --max-turns searches of --top-k passages each could pass the model's context mid-run (the
    tiny model's 2,048 positions: 3 searches of 3 passages of about 320 tokens each, 2,900 tokens before the prompt).
    Now --top-k is refused before the run, with the numbers and the --top-k that fits; that one passes the check."""
    import re

    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(12):  # passages of about 290 characters: about 320 tokens each shown (character tokens)
        (folder / f"town_{i}.md").write_text(f"Town {i} lies on the river. " * 10 + "\n")
    monkeypatch.setattr(qa, "format_prompt", lambda tokenizer, question: f"Q: {question}\nA:")
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "Where is Brio?", "answer": "Miogriarary"}] * 4)
    argv = ["--model-name", tiny_model_dir, "--device", "cpu", "--quantization", "none", "--dtype", "float32",
            "--data-path", data, "--eval-data-path", data, "--corpus-dir", folder, "--retriever", "bm25",
            "--max-turns", "3", "--max-length", "16", "--group-size", "2", "--rollouts-per-step", "1",
            "--max-steps", "1", "--eval-interval", "0", "--log-dir", tmp_path / "runs", "--checkpoint-path",
            tmp_path / "out"]
    said = fails_with(qa, argv + ["--top-k", "3"], capsys)  # sys.exit's message, then stderr
    message = said.splitlines()[0]
    assert message.startswith("error: --top-k 3: ") and "2048" in message and "--max-turns 3" in message, message
    fits = int(re.search(r"--top-k (\d+) fits", message).group(1))
    assert 1 <= fits < 3
    module, model, tokenizer = load_tiny(qa, tiny_model_dir)
    tasks = [{"question": "Where is Brio?", "prompt": "Q: Where is Brio?\nA:"}]
    for k in fits, fits + 1:
        args = qa.parse_args([str(a) for a in argv + ["--top-k", k]])
        search = qa.make_search(qa.SearchIndex(folder, "bm25"), args.top_k, args.passage_chars)
        if k == fits:
            qa.check_context(model, tokenizer, args, tasks, tasks, search)  # fits: no error
        else:
            with pytest.raises(qa.InputError, match=f"--top-k {k}: "):
                qa.check_context(model, tokenizer, args, tasks, tasks, search)


# -- Nothing lost, round four (issue 71)


@pytest.mark.parametrize("answer", ["A", "The", "?!"])
def test_an_answer_that_normalisation_empties_is_refused_by_line(qa, corpus, tmp_path, capsys, answer):
    """Item 17: an answer that normalisation empties (an article, punctuation) was accepted, and no completion could
    ever be rewarded for it. Now load_tasks refuses it, naming the file and the line, before the model loads."""
    data = write_jsonl(tmp_path / "q.jsonl", [{"question": "Where is Brio?", "answer": "Miogriarary"},
                                              {"question": "Which letter comes first?", "answer": answer}])
    argv = ["--device", "cpu", "--model-name", "not-loaded", "--data-path", data, "--eval-interval", "0",
            "--corpus-dir", corpus, "--retriever", "bm25", "--log-dir", tmp_path / "runs", "--checkpoint-path",
            tmp_path / "out"]
    message = fails_with(qa, argv, capsys)
    assert message.strip() == (f"error: {data}:2: field 'answer' is {answer!r}, which normalisation (lower case, no "
                               "punctuation or articles) empties: no completion can match it")
