"""Recall@k of experiment_multiturn_qa's search tool on the generated corpus, each question searched verbatim.

    python benchmarks/retrieval.py                              # dense and bm25, top 3, every question
    python benchmarks/retrieval.py --retrievers bm25 --top-k 5 --json recall.json

For each retriever: the share of single-hop questions with a cited passage in the top k, and with the answer
in a passage of the top k (normalised, whole words, as the experiment's retrieval reward counts it); and of
two-hop questions with the first hop's passage in the top k, and with the answer there, which one search
rarely finds: the model has to search again for the entity that the first passage names.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from common import ROOT, load_experiment, machine, output_file, write_json

QA = ROOT / "data" / "qa"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--retrievers", nargs="+", default=["dense", "bm25"], help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=3, help="passages per search (default: %(default)s)")
    p.add_argument("--corpus-dir", type=Path, default=QA / "corpus", help="(default: data/qa/corpus)")
    p.add_argument("--questions", type=Path, nargs="+", default=[QA / "questions.jsonl", QA / "questions_eval.jsonl"],
                   help="JSONL with question, answer, passage_ids, hops (default: the training and held-out files)")
    p.add_argument("--max-questions", type=int, default=None, help="the first N questions only (default: all)")
    p.add_argument("--json", type=output_file, help="also write the table as JSON here")
    args = p.parse_args(argv)
    if args.top_k < 1:
        p.error(f"--top-k must be at least 1, got {args.top_k}")
    return args


def recall(rows, results, answer_in):
    """{measure: share of rows} for one retriever's results (a list of passages per row)."""

    def cited(row, found):  # a passage a single-hop question cites (some cite two), or a two-hop one's first hop
        wanted = set(row["passage_ids"]) if row["hops"] == 1 else {row["passage_ids"][0]}
        return bool(wanted & {p.id for p in found})

    def answered(row, found):
        return any(answer_in(p.text, row["answer"]) for p in found)

    def share(hops, hit):
        chosen = [(row, found) for row, found in zip(rows, results) if row["hops"] == hops]
        return sum(hit(row, found) for row, found in chosen) / max(1, len(chosen))

    return {"single_hop_cited": share(1, cited), "single_hop_answer": share(1, answered),
            "two_hop_first_cited": share(2, cited), "two_hop_answer": share(2, answered)}


def main(argv=None):
    args = parse_args(argv)
    qa = load_experiment("experiment_multiturn_qa")  # its search tool and its answer normalisation
    rows = [json.loads(line) for path in args.questions for line in path.read_text().splitlines() if line.strip()]
    rows = rows[: args.max_questions]
    table = {}
    for retriever in args.retrievers:
        started = time.perf_counter()
        index = qa.SearchIndex(args.corpus_dir, retriever)
        built = time.perf_counter()
        results = index.search_batch([r["question"] for r in rows], top_k=args.top_k)
        table[retriever] = {**recall(rows, results, qa.answer_in), "index_seconds": built - started,
                            "search_seconds": time.perf_counter() - built}
    singles = sum(r["hops"] == 1 for r in rows)
    print(f"\nrecall@{args.top_k}, {len(rows)} questions ({singles} single-hop, {len(rows) - singles} two-hop)\n")
    print("| retriever | single-hop: cited passage | single-hop: answer | two-hop: first hop's passage | two-hop: answer |")
    print("| --- | --- | --- | --- | --- |")
    for retriever, r in table.items():
        print(f"| {retriever} | {r['single_hop_cited']:.1%} | {r['single_hop_answer']:.1%} | "
              f"{r['two_hop_first_cited']:.1%} | {r['two_hop_answer']:.1%} |")
    write_json(args.json, {"top_k": args.top_k, "questions": len(rows), "recall": table},
               machine("float32 (all-MiniLM-L6-v2, the dense retriever)"))


if __name__ == "__main__":
    sys.exit(main())
