"""The fictional QA corpus (data/make_qa_corpus.py) and the search tool (experiment_multiturn_qa/search.py)."""

import json
import random
import re
import time

import pytest
from common import load_module
from conftest import ROOT, run_script, write_pdf

GENERATOR = ROOT / "data" / "make_qa_corpus.py"
SEARCH = ROOT / "experiment_multiturn_qa" / "search.py"
QA = ROOT / "data" / "qa"


search = load_module(SEARCH, "qa_search")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def file_bytes(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def contains(text, answer):  # whole words: "1893" is not inside "18930"
    return re.search(r"(?<!\w)" + re.escape(answer) + r"(?!\w)", text) is not None


@pytest.fixture(scope="module")
def corpus_passages():
    """{passage id: text} of the committed corpus, as search.py chunks it."""
    return {p.id: p.text for p in search.load_passages(QA / "corpus")}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("search-cache")


@pytest.fixture(scope="module")
def dense_index(cache_dir):
    return search.SearchIndex(QA / "corpus", "dense", cache_dir=cache_dir)


# ---------------------------------------------------------------- the corpus generator

def test_corpus_is_reproducible_and_committed(tmp_path):
    for run in ("a", "b"):
        result = run_script(GENERATOR, "--out-dir", tmp_path / run)
        assert result.returncode == 0, result.stderr
    fresh = file_bytes(tmp_path / "a")
    assert fresh == file_bytes(tmp_path / "b")  # same seed, same bytes
    assert fresh == file_bytes(QA), "data/qa differs from a default run of data/make_qa_corpus.py: re-run it"
    assert 300 <= len(list((QA / "corpus").glob("*.md"))) <= 1000
    assert sum(len(b) for b in fresh.values()) < 3_000_000  # committed: keep it modest


def test_generator_options_and_seed(tmp_path):
    args = ["--people", 30, "--towns", 10, "--orgs", 10, "--regions", 3, "--train-questions", 80,
            "--eval-questions", 20, "--seed", 1, "--out-dir", tmp_path]
    assert run_script(GENERATOR, *args).returncode == 0
    assert len(list((tmp_path / "corpus").glob("*.md"))) == 53
    train, held_out = read_jsonl(tmp_path / "questions.jsonl"), read_jsonl(tmp_path / "questions_eval.jsonl")
    assert len(train) == 80 and len(held_out) == 20
    assert train[:5] != read_jsonl(QA / "questions.jsonl")[:5]
    bad = run_script(GENERATOR, "--regions", 0, "--out-dir", tmp_path)
    assert bad.returncode != 0 and "--regions" in bad.stderr


def test_questions_are_answerable_from_their_passages(corpus_passages):
    train, held_out = read_jsonl(QA / "questions.jsonl"), read_jsonl(QA / "questions_eval.jsonl")
    assert len(train) >= 2000 and len(held_out) >= 200
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}  # held out means held out
    assert len({r["question"] for r in train + held_out}) == len(train + held_out)
    for rows in (train, held_out):
        assert abs(sum(r["hops"] == 1 for r in rows) - len(rows) / 2) <= len(rows) * 0.1  # about half each
    titles = {stem: (QA / "corpus" / f"{stem}.md").read_text().splitlines()[0].removeprefix("# ")
              for stem in {pid.split("#")[0] for pid in corpus_passages}}
    for row in train + held_out:
        assert isinstance(row["question"], str) and isinstance(row["answer"], str) and row["answer"]
        assert set(row["passage_ids"]) <= corpus_passages.keys(), row  # the chunker makes exactly these ids
        cited = [corpus_passages[pid] for pid in row["passage_ids"]]
        assert any(contains(text, row["answer"]) for text in cited), row
        docs = [pid.split("#")[0] for pid in row["passage_ids"]]
        if row["hops"] == 1:
            assert any(titles[doc] in row["question"] for doc in docs), row
            continue
        assert row["hops"] == 2 and len(docs) == 2 and docs[0] != docs[1], row
        named, middle = docs
        assert titles[named] in row["question"] and not contains(row["question"], titles[middle]), row
        assert titles[middle] in cited[0] and contains(cited[1], row["answer"]), row  # the chain A -> B -> answer
        own = " ".join(text for pid, text in corpus_passages.items() if pid.split("#")[0] == named)
        assert not contains(own, row["answer"]), row  # one search for the named entity is not enough


# ---------------------------------------------------------------- chunking and the index

def test_chunking_merges_titles_and_splits_long_paragraphs():
    long = " ".join(f"Sentence number {i} says something about the harbour." for i in range(60))
    chunks = search.chunk_text(f"# Title\n\n{long}\n\nShort tail.")
    assert chunks[0].startswith("# Title\nSentence number 0")  # the heading joins the paragraph after it
    assert len(chunks) >= 3 and all(len(c) <= search.MAX_CHARS + search.MIN_CHARS for c in chunks)
    assert chunks[-1].endswith("\nShort tail.")  # a short tail joins the passage before it
    assert " ".join(c.replace("\n", " ") for c in chunks) == f"# Title {long} Short tail."  # nothing lost


@pytest.mark.parametrize("retriever", ["dense", "bm25"])
def test_retrieval_finds_single_hop_passages(retriever, dense_index):
    index = dense_index if retriever == "dense" else search.SearchIndex(QA / "corpus", "bm25")
    rows = [r for r in read_jsonl(QA / "questions.jsonl") if r["hops"] == 1]
    rows = random.Random(0).sample(rows, 200)
    results = index.search_batch([r["question"] for r in rows], top_k=3)
    hits = sum(bool({p.id for p in found} & set(r["passage_ids"])) for r, found in zip(rows, results))
    assert hits / len(rows) >= 0.9, f"{retriever} recall@3 {hits / len(rows):.2f}"
    best = results[0][0]
    assert best.source == best.id.split("#")[0] + ".md" and best.text and best.score > 0
    assert [p.score for p in results[0]] == sorted((p.score for p in results[0]), reverse=True)


def test_dense_index_is_cached(dense_index, cache_dir):
    start = time.perf_counter()
    again = search.SearchIndex(QA / "corpus", "dense", cache_dir=cache_dir)
    seconds = time.perf_counter() - start
    assert not dense_index.loaded_from_cache and again.loaded_from_cache
    assert seconds < dense_index.build_seconds / 3, (seconds, dense_index.build_seconds)
    query = "In which town was the founder of the printing company born?"
    assert [p.id for p in again.search(query)] == [p.id for p in dense_index.search(query)]


def test_pdf_markdown_and_text_files_are_searchable(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "notes").mkdir(parents=True)
    write_pdf(corpus / "manual.pdf", [
        ["The Velmora Lighthouse was built in 1823 by the harbour master Orrin Quade,", "who also kept its lamp."],
        ["The lighthouse keeper Sella Brinn counted ninety ships in the great storm of the winter."]])
    (corpus / "notes" / "garden.md").write_text("# Garden\n\nThe moon orchid of Tessary blooms only in the "
                                                "second week of the rainy season, and smells of pepper.\n")
    (corpus / "recipe.txt").write_text("Grandmother Ulla bakes her famous rye bread with caraway seeds "
                                       "and dark honey every Sunday morning.\n")
    (corpus / "ignored.csv").write_text("a,b\n")
    for retriever in ("dense", "bm25"):
        index = search.SearchIndex(corpus, retriever, cache_dir=tmp_path / "cache")
        assert sorted(p.id for p in index.passages) == ["manual#0", "manual#1", "notes/garden#0", "recipe#0"]
        pdf = index.search("Who built the Velmora Lighthouse?", top_k=2)
        assert pdf[0].id == "manual#0" and pdf[0].source == "manual.pdf" and "Orrin Quade" in pdf[0].text
        assert index.search("When does the moon orchid bloom?", top_k=1)[0].id == "notes/garden#0"
        assert index.search("How many ships in the storm?", top_k=1)[0].id == "manual#1"  # page 2
        text = search.format_passages(pdf)
        assert text.startswith("Doc 1 (manual#0):\n") and "Doc 2 (" in text
    assert search.format_passages([]) == "No results." and index.search("   ") == []
    (corpus / "recipe.txt").write_text("Changed.\n")  # a changed corpus is embedded again
    assert not search.SearchIndex(corpus, "dense", cache_dir=tmp_path / "cache").loaded_from_cache


def test_cli_prints_passages(cache_dir, dense_index):
    org = (QA / "corpus" / "org_0003.md").read_text().splitlines()[0].removeprefix("# ")
    for retriever in ("dense", "bm25"):
        result = run_script(SEARCH, "--corpus-dir", QA / "corpus", "--retriever", retriever, "--cache-dir", cache_dir,
                            "--top-k", 2, f"Who founded the {org}?", timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("Doc 1 (org_0003#"), result.stdout
        assert "Doc 2 (" in result.stdout and "Doc 3" not in result.stdout


# ---------------------------------------------------------------- errors

def test_clear_errors(tmp_path):
    with pytest.raises(search.SearchError, match=re.escape(str(tmp_path / "missing"))):
        search.SearchIndex(tmp_path / "missing", "bm25")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.csv").write_text("a,b\n")
    with pytest.raises(search.SearchError, match="no .md, .txt, .pdf files in corpus folder .*empty"):
        search.SearchIndex(tmp_path / "empty", "bm25")
    with pytest.raises(search.SearchError, match="unknown retriever 'tfidf'"):
        search.SearchIndex(QA / "corpus", "tfidf")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "scan.pdf").write_bytes(b"this is not a PDF at all")
    with pytest.raises(search.SearchError, match=r"cannot read PDF .*scan\.pdf"):
        search.SearchIndex(tmp_path / "broken", "bm25")
    result = run_script(SEARCH, "--corpus-dir", tmp_path / "missing", "--retriever", "bm25", "query")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "missing" in result.stderr


# -- Nothing lost, round four (issue 71)

def test_a_dense_cache_that_cannot_be_written_warns_and_the_index_is_used(tmp_path, caplog):
    """Item 13: a cache folder that cannot be written (TINY_GRPO_CACHE naming a file, a read-only disk) ended the run
    with a traceback after the index was built. Now one warning names the folder and the reason, and the index built
    in memory is searched; the file in the way is left alone."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "brio.md").write_text("# Brio\n\nBrio is a town in Miogriarary. It was first recorded in 927 and grew "
                                    "around a ferry crossing.\n")
    (tmp_path / "cache").write_text("not a folder")
    index = search.SearchIndex(corpus, "dense", cache_dir=tmp_path / "cache" / "search")
    assert not index.loaded_from_cache and index.search("Where is Brio?", top_k=1)[0].id == "brio#0"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"cannot write the index cache in {tmp_path / 'cache' / 'search' / 'dense-'}"), warning
    assert "NotADirectoryError" in warning and "\n" not in warning
    assert (tmp_path / "cache").read_text() == "not a folder"
