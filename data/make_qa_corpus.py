"""Write a fictional knowledge base and questions about it, for the multi-turn search experiment.

No language model can know these facts (every name is invented), so answering needs the search tool.
Output, under --out-dir (default data/qa):
  corpus/person_0001.md, town_0001.md, org_0001.md, region_0001.md   one markdown document per entity
  questions.jsonl        training questions
  questions_eval.jsonl   held-out questions (no question is in both files)

A document is a title line ("# Name") and a few paragraphs. Passage ids are `<document stem>#<paragraph
index>`, counted from 0, with the title belonging to paragraph 0: exactly what the chunker of
experiment_multiturn_qa/search.py produces for this corpus (every paragraph is long enough not to be merged).
Each question line is {"question", "answer", "passage_ids", "hops", "type"}:
  hops 1: the answer is in one passage; passage_ids lists every passage that states the fact.
  hops 2: the question names entity A, A's passage names B (never named in the question), B's passage holds
          the answer; passage_ids is [A's passage, B's passage], and A's document never contains the answer.

    python data/make_qa_corpus.py                         # ~500 documents, 3,000 + 500 questions
    python data/make_qa_corpus.py --people 40 --train-questions 200 --eval-questions 50 --out-dir /tmp/qa
"""

import argparse
import json
import random
import re
from pathlib import Path

# Invented words are built from syllables; a word is used for one name only, so every answer is unambiguous.
ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kh", "l", "m", "n", "p", "qu", "r", "s", "sk", "st",
          "t", "th", "tr", "v", "vr", "z", "y", "ch", "j"]
VOWELS = ["a", "e", "i", "o", "u", "ae", "ai", "ei", "ia", "io", "ou", "y"]
CODAS = ["", "", "", "n", "r", "l", "s", "m", "th", "nd", "rk", "x", "sk", "v", "ll", "rn", "sh"]
TOWN_SUFFIXES = ["", "", "holm", "mere", "wick", "ford", "gate", "by", "stead", "haven", "dale", "thorpe"]
REGION_SUFFIXES = ["ia", "mark", "land", "ary", "avia", "ora", "eth"]
ORG_KINDS = {  # kind of organisation -> fields it works in
    "Company": ["shipping", "textiles", "clockmaking", "printing", "brewing", "salt mining"],
    "Guild": ["glassmaking", "bookbinding", "stonemasonry", "weaving", "cartography"],
    "Institute": ["astronomy", "botany", "geology", "medicine", "linguistics"],
    "Society": ["natural history", "music", "archaeology", "meteorology"],
    "Works": ["ironworking", "porcelain", "rope making", "shipbuilding"],
}
OCCUPATIONS = ["cartographer", "glassblower", "botanist", "engineer", "clockmaker", "printer", "astronomer",
               "surveyor", "chemist", "weaver", "architect", "physician", "bookbinder", "geologist", "shipwright",
               "archivist", "linguist", "composer", "apothecary", "stonemason", "brewer", "teacher", "accountant"]

# Prose pieces without names or numbers: they make the documents read naturally and add distractor text.
CHILDHOOD = ["{s} was the eldest of four children and spent long summers helping in the family workshop.",
             "{s} grew up above a bakery and was taught to read by a travelling schoolmaster.",
             "As a child, {s} was known for collecting stones and pressed flowers from the nearby hills.",
             "{s} attended the local grammar school and showed an early talent for drawing.",
             "The family was poor, and {s} left school early to earn a living."]
CAREER = ["Colleagues remembered {s} as patient, exacting and fond of long walks.",
          "{s} kept detailed notebooks that are still consulted by students today.",
          "Over the years {s} trained a large number of apprentices.",
          "{s} rose quickly through the ranks and was admired for careful work.",
          "Contemporaries described {s} as quiet in company but stubborn in argument."]
LATER = ["In later life {s} turned to gardening and wrote a short memoir about the early years.",
         "{s} spent the final years of life travelling and writing long letters to former colleagues.",
         "A small street near the old harbour was later named after {s} by the town council.",
         "{s} never married and left most possessions, including many books, to a local library.",
         "After retiring, {s} taught evening classes for adults and sang in a church choir."]
TOWN_HISTORY = ["The old market square is still lined with timber-framed houses.",
                "A stone bridge built by the first settlers still carries the main road.",
                "The town grew around a ferry crossing and a small chapel.",
                "Much of the old centre burned in a great fire and was rebuilt in brick."]
TOWN_ECONOMY = ["Its economy rests on farming, a weekly cattle market and a small tannery.",
                "Most residents work in the nearby quarries or in the mills along the river.",
                "Visitors come for the spring fair and the hot springs outside the walls.",
                "The town is known for its orchards, its apple fair and its dark, sweet cider."]
ORG_ORIGIN = ["It began as a handful of friends meeting in a rented room.",
              "Its first home was a borrowed warehouse near the docks.",
              "It started with a small loan and a single workshop.",
              "Its founding charter was signed by eleven members."]
ORG_ACTIVITY = ["It is best known for a series of handsome catalogues published over many decades.",
                "Its members meet every spring to share their work and elect a council.",
                "It has trained several generations of apprentices in its workshops.",
                "Its archive of letters and drawings is open to visiting scholars."]
REGION_LAND = ["The landscape is a mix of low hills, wide river valleys and pine forest.",
               "Most of the region is farmland, with marshes along its coast.",
               "High moorland covers the north of the region, and vineyards the south.",
               "The region is crossed by an old trade road that links its market towns."]
REGION_CAPITAL = ["The regional council meets there four times a year.",
                  "Roads from every corner of the region meet at its market square.",
                  "It has been the seat of the regional court for centuries."]

# Question templates: {a} is the entity named in the question. Two phrasings each, chosen at random.
ONE_HOP = {
    "person.birth_year": ["In which year was {a} born?", "What year was {a} born in?"],
    "person.birthplace": ["In which town was {a} born?", "What is the birthplace of {a}?"],
    "person.occupation": ["What was the occupation of {a}?", "What did {a} work as?"],
    "person.employer": ["Which organisation did {a} work for?", "Who employed {a}?"],
    "person.death_year": ["In which year did {a} die?", "What year did {a} die in?"],
    "org.founding_year": ["In which year was {a} founded?", "When was {a} founded?"],
    "org.founder": ["Who founded {a}?", "Who was the founder of {a}?"],
    "org.headquarters": ["In which town is {a} headquartered?", "Where does {a} have its headquarters?"],
    "org.field": ["In which field does {a} work?", "What field is {a} active in?"],
    "town.region": ["In which region is {a}?", "Which region is {a} located in?"],
    "town.first_recorded": ["In which year was {a} first recorded?", "When was {a} first recorded?"],
    "town.population": ["What is the population of {a}?", "How many people live in {a}?"],
    "region.capital": ["What is the capital of {a}?", "Which town is the capital of {a}?"],
    "region.area": ["How many square kilometres does {a} cover?", "What is the area of {a} in square kilometres?"],
}
# (first relation, second fact) -> templates; the intermediate entity is never named.
TWO_HOP = {
    ("person.birthplace", "town.region"): ["In which region is the town where {a} was born?",
                                           "Which region contains the birthplace of {a}?"],
    ("person.birthplace", "town.population"): ["What is the population of the town where {a} was born?",
                                               "How many people live in the birthplace of {a}?"],
    ("person.birthplace", "town.first_recorded"): ["In which year was the birthplace of {a} first recorded?",
                                                   "When was the town where {a} was born first recorded?"],
    ("person.employer", "org.founding_year"): ["In which year was the organisation {a} worked for founded?",
                                               "When was the employer of {a} founded?"],
    ("person.employer", "org.founder"): ["Who founded the organisation that {a} worked for?",
                                         "Who was the founder of the employer of {a}?"],
    ("person.employer", "org.headquarters"): ["In which town is the employer of {a} headquartered?",
                                              "Where does the organisation {a} worked for have its headquarters?"],
    ("org.founder", "person.birth_year"): ["In which year was the founder of {a} born?",
                                           "What year was the person who founded {a} born in?"],
    ("org.founder", "person.birthplace"): ["In which town was the founder of {a} born?",
                                           "What is the birthplace of the person who founded {a}?"],
    ("org.founder", "person.death_year"): ["In which year did the founder of {a} die?",
                                           "What year did the person who founded {a} die in?"],
    ("org.headquarters", "town.region"): ["In which region is the town where {a} has its headquarters?",
                                          "Which region contains the headquarters town of {a}?"],
    ("org.headquarters", "town.population"): ["What is the population of the town where {a} is headquartered?",
                                              "How many people live in the headquarters town of {a}?"],
    ("region.capital", "town.population"): ["What is the population of the capital of {a}?",
                                            "How many people live in the capital of {a}?"],
    ("region.capital", "town.first_recorded"): ["In which year was the capital of {a} first recorded?",
                                                "When was the capital of {a} first recorded?"],
    ("town.region", "region.capital"): ["What is the capital of the region that {a} is in?",
                                        "Which town is the capital of the region containing {a}?"],
    ("town.region", "region.area"): ["How many square kilometres does the region containing {a} cover?",
                                     "What is the area in square kilometres of the region that {a} is in?"],
}


class Names:
    """Invented words, each handed out once (case-insensitively), so no two names share a word."""

    def __init__(self, rng):
        self.rng, self.used = rng, set()

    def word(self, syllables, suffix=""):
        while True:
            word = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables))
            word += self.rng.choice(CODAS) + suffix
            awkward = re.search(r"(.)\1\1|hh|yy|quu|ii|uu|yi|iy", word)
            if 4 <= len(word) <= 12 and not awkward and word not in self.used:
                self.used.add(word)
                return word.capitalize()


def make_world(rng, num_people, num_towns, num_orgs, num_regions):
    """Entities as dicts: {"id", "name", <facts>}; a fact that names another entity holds its index."""
    names = Names(rng)
    regions = [{"id": f"region_{i + 1:04d}", "name": names.word(rng.choice([1, 2]), rng.choice(REGION_SUFFIXES)),
                "area": rng.randrange(1200, 40000)} for i in range(num_regions)]
    towns = [{"id": f"town_{i + 1:04d}", "name": names.word(rng.choice([1, 2]), rng.choice(TOWN_SUFFIXES)),
              "region": i % num_regions if i < num_regions else rng.randrange(num_regions),  # no empty region
              "first_recorded": rng.randrange(900, 1750), "population": rng.randrange(800, 250_000)}
             for i in range(num_towns)]
    for r, region in enumerate(regions):
        region["capital"] = rng.choice([t for t, town in enumerate(towns) if town["region"] == r])
    people = [{"id": f"person_{i + 1:04d}", "name": f"{names.word(2)} {names.word(rng.choice([1, 2, 3]))}",
               "birth_year": rng.randrange(1780, 1920), "birthplace": rng.randrange(num_towns),
               "occupation": rng.choice(OCCUPATIONS)} for i in range(num_people)]
    for person in people:
        person["death_year"] = person["birth_year"] + rng.randrange(35, 95)
    orgs = []
    for i, founder in enumerate(rng.sample(range(num_people), num_orgs)):  # each founder founds one organisation
        kind = rng.choice(sorted(ORG_KINDS))
        birth, death = people[founder]["birth_year"], people[founder]["death_year"]
        orgs.append({"id": f"org_{i + 1:04d}", "name": f"{names.word(rng.choice([1, 2]))} {kind}",
                     "field": rng.choice(ORG_KINDS[kind]), "founder": founder,
                     "founding_year": rng.randrange(birth + 20, max(birth + 21, min(death, birth + 70))),
                     "headquarters": rng.randrange(num_towns)})
        people[founder]["founded"] = i
    for person in people:  # employers founded before the person turned 50; a founder works for their own
        if "founded" in person:
            person["employer"] = person["founded"]
        else:
            options = [o for o, org in enumerate(orgs) if org["founding_year"] <= person["birth_year"] + 50]
            person["employer"] = rng.choice(options or range(num_orgs))
    return {"person": people, "town": towns, "org": orgs, "region": regions}


def a_or_an(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def write_documents(world, rng):
    """{doc id: [(paragraph text, set of facts it states)]}; a fact is (entity type, index, attribute)."""
    people, towns, orgs, regions = world["person"], world["town"], world["org"], world["region"]
    docs = {}
    for p, person in enumerate(people):
        n, s = person["name"], person["name"].split()[1]
        town, org = towns[person["birthplace"]]["name"], orgs[person["employer"]]["name"]
        last_text = f"{n} died in {person['death_year']}. " + rng.choice(LATER).format(s=s)
        last_facts = {("person", p, "death_year")}
        if "founded" in person:  # a founder's biography names the organisation too
            o = person["founded"]
            last_text = f"{n} founded the {orgs[o]['name']} in {orgs[o]['founding_year']}. " + last_text
            last_facts |= {("org", o, "founder"), ("org", o, "founding_year")}
        docs[person["id"]] = [
            (f"{n} was born in {person['birth_year']} in the town of {town}. " + rng.choice(CHILDHOOD).format(s=s),
             {("person", p, "birth_year"), ("person", p, "birthplace")}),
            (f"{n} worked as {a_or_an(person['occupation'])} for the {org}. " + rng.choice(CAREER).format(s=s),
             {("person", p, "occupation"), ("person", p, "employer")}),
            (last_text, last_facts),
        ]
    for t, town in enumerate(towns):
        n = town["name"]
        docs[town["id"]] = [
            (f"{n} is a town in {regions[town['region']]['name']}. It was first recorded in {town['first_recorded']}. "
             + rng.choice(TOWN_HISTORY), {("town", t, "region"), ("town", t, "first_recorded")}),
            (f"{n} has a population of {town['population']}. " + rng.choice(TOWN_ECONOMY), {("town", t, "population")}),
        ]
    for o, org in enumerate(orgs):
        n = org["name"]
        docs[org["id"]] = [
            (f"The {n} was founded in {org['founding_year']} by {people[org['founder']]['name']}. "
             f"It works in the field of {org['field']}. " + rng.choice(ORG_ORIGIN),
             {("org", o, "founding_year"), ("org", o, "founder"), ("org", o, "field")}),
            (f"The {n} has its headquarters in {towns[org['headquarters']]['name']}. " + rng.choice(ORG_ACTIVITY),
             {("org", o, "headquarters")}),
        ]
    for r, region in enumerate(regions):
        n, members = region["name"], [t for t, town in enumerate(towns) if town["region"] == r]
        others = [towns[t]["name"] for t in members if t != region["capital"]]
        listing = (" Its other towns are " + ", ".join(others[:-1]) + (" and " if len(others) > 1 else "") + others[-1]
                   + ".") if others else ""
        docs[region["id"]] = [
            (f"{n} is a region covering {region['area']} square kilometres. " + rng.choice(REGION_LAND),
             {("region", r, "area")}),
            (f"The capital of {n} is {towns[region['capital']]['name']}.{listing} " + rng.choice(REGION_CAPITAL),
             {("region", r, "capital")} | {("town", t, "region") for t in members}),
        ]
    return docs


def answer_of(world, kind, index, attribute):
    """(answer string, the entity the fact points to or None) for one fact."""
    value = world[kind][index][attribute]
    target = {"birthplace": "town", "employer": "org", "founder": "person", "headquarters": "town",
              "region": "region", "capital": "town"}.get(attribute)
    return (world[target][value]["name"], (target, value)) if target else (str(value), None)


def contains(text, answer):
    """Whole-word match, so that "1893" is not found inside "18930"."""
    return re.search(r"(?<!\w)" + re.escape(answer) + r"(?!\w)", text) is not None


def make_questions(world, docs, rng):
    """All one-hop and two-hop questions the world supports: (one_hop, two_hop) lists of dicts."""
    where = {}  # fact -> passage ids that state it
    for doc_id, paragraphs in docs.items():
        for i, (_, facts) in enumerate(paragraphs):
            for fact in facts:
                where.setdefault(fact, []).append(f"{doc_id}#{i}")
    own = lambda kind, index, attribute: next(pid for pid in where[(kind, index, attribute)]  # noqa: E731
                                              if pid.startswith(world[kind][index]["id"] + "#"))
    one_hop, two_hop = [], []
    for qtype, templates in ONE_HOP.items():
        kind, attribute = qtype.split(".")
        for index, entity in enumerate(world[kind]):
            answer, _ = answer_of(world, kind, index, attribute)
            one_hop.append({"question": rng.choice(templates).format(a=entity["name"]), "answer": answer,
                            "passage_ids": sorted(where[(kind, index, attribute)]), "hops": 1, "type": qtype})
    for (first, second), templates in TWO_HOP.items():
        kind, attribute = first.split(".")
        for index, entity in enumerate(world[kind]):
            _, (mid_kind, mid) = answer_of(world, kind, index, attribute)
            answer, _ = answer_of(world, mid_kind, mid, second.split(".")[1])
            own_text = " ".join(text for text, _ in docs[entity["id"]])
            if contains(own_text, answer):  # e.g. a founder who works for their own organisation: one hop suffices
                continue
            two_hop.append({"question": rng.choice(templates).format(a=entity["name"]), "answer": answer,
                            "passage_ids": [own(kind, index, attribute), own(mid_kind, mid, second.split(".")[1])],
                            "hops": 2, "type": f"{first}>{second}"})
    return one_hop, two_hop


def split_questions(one_hop, two_hop, train_size, eval_size, rng):
    """Half one-hop, half two-hop in each split (as far as the world allows); no question in both."""
    train, held_out = [], []
    for pool in (one_hop, two_hop):
        pool = rng.sample(pool, len(pool))
        n_eval = min(eval_size // 2, len(pool))
        held_out += pool[:n_eval]
        train += pool[n_eval:n_eval + (train_size + 1) // 2]
    rng.shuffle(train)
    rng.shuffle(held_out)
    return train, held_out


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--people", type=int, default=300, help="person documents (default: %(default)s)")
    parser.add_argument("--towns", type=int, default=80, help="town documents (default: %(default)s)")
    parser.add_argument("--orgs", type=int, default=100, help="organisation documents (default: %(default)s)")
    parser.add_argument("--regions", type=int, default=16, help="region documents (default: %(default)s)")
    parser.add_argument("--train-questions", type=int, default=3000, help="training questions (default: %(default)s)")
    parser.add_argument("--eval-questions", type=int, default=500, help="held-out questions (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "qa",
                        help="output folder (default: data/qa)")
    args = parser.parse_args(argv)
    if not 1 <= args.regions <= args.towns:
        parser.error("need 1 <= --regions <= --towns (every region has a town as its capital)")
    if not 1 <= args.orgs <= args.people:
        parser.error("need 1 <= --orgs <= --people (every organisation has its own founder)")
    if args.train_questions < 1 or args.eval_questions < 0:
        parser.error("--train-questions must be at least 1 and --eval-questions at least 0")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"--out-dir {args.out_dir}: a file, not a folder")

    rng = random.Random(args.seed)
    world = make_world(rng, args.people, args.towns, args.orgs, args.regions)
    docs = write_documents(world, rng)
    # search.py merges a block under 80 characters (a title) into the next one: longer paragraphs keep their ids.
    if any(len(text) < 100 for paragraphs in docs.values() for text, _ in paragraphs):
        parser.error("a world this small writes paragraphs too short to be passages of their own: give it more "
                     "people, towns and organisations (--people 10 --towns 4 --orgs 3 --regions 1 is enough)")
    one_hop, two_hop = make_questions(world, docs, rng)
    train, held_out = split_questions(one_hop, two_hop, args.train_questions, args.eval_questions, rng)
    if len(train) < args.train_questions or len(held_out) < args.eval_questions:
        parser.error(f"this world holds {len(one_hop) + len(two_hop)} questions, not the {args.train_questions} + "
                     f"{args.eval_questions} asked: ask for fewer, or give it more people, towns and organisations")

    corpus = args.out_dir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for old in corpus.glob("*.md"):  # a smaller re-run must not leave stale documents behind
        if re.fullmatch(r"(person|town|org|region)_\d{4}\.md", old.name):
            old.unlink()
    for kind, entities in world.items():
        for entity in entities:
            body = "\n\n".join(text for text, _ in docs[entity["id"]])
            (corpus / f"{entity['id']}.md").write_text(f"# {entity['name']}\n\n{body}\n", encoding="utf-8")
    write_jsonl(args.out_dir / "questions.jsonl", train)
    write_jsonl(args.out_dir / "questions_eval.jsonl", held_out)
    hops = lambda rows: [sum(r["hops"] == h for r in rows) for h in (1, 2)]  # noqa: E731
    print(f"wrote {len(docs)} documents to {corpus}, {len(train)} training questions (1-hop, 2-hop: {hops(train)}) "
          f"and {len(held_out)} held-out questions ({hops(held_out)})")


if __name__ == "__main__":
    main()
