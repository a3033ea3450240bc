"""Answer checks: numbers read exactly, and the other tasks' answers (LaTeX by math-verify, whole numbers in words,
knight/knave roles); rewards that no float32 group can hold are refused."""

import logging, re  # noqa: E401
from fractions import Fraction

from tiny_grpo.errors import RewardError

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")

def parse_number(text):
    """The last number in a text, exactly: '1,234' '12.0' '$5' '7.' '12 apples' '\\boxed{42}' '-3' '1/2' '1.5/2'."""
    numbers = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text or ""))  # without thousands separators
    for number in reversed(numbers):  # no answer has 100 digits; a longer one costs seconds to compare (or raises)
        numerator, _, denominator = number.partition("/")  # '1.5/2' is 3/4 (Fraction takes no decimal over a number)
        if len(number) <= 100 and int(denominator or 1) != 0:  # a/0 is no number
            return Fraction(numerator) / int(denominator or 1)
    return None

ROLE_CLAIM = re.compile(r"\b[A-Z][a-z]+(?:\s+is(?:\s+not)?\s+an?|\s*:)\s+(?i:knight|knave)\b")  # 'Zoey is a knight', 'Ethan: knave'

NUMBER_WORDS = {word: i for i, word in enumerate("zero one two three four five six seven eight nine ten eleven twelve "
                                                 "thirteen fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}

def parse_count(text):
    """The last whole number in a text, in digits or in words up to twenty: '4', 'four', '4 words' -> 4; else None."""
    found = re.findall(rf"-?\d+(?:\.\d+)?|\b(?:{'|'.join(NUMBER_WORDS)})\b", (text or "").lower())
    if not found or len(found[-1]) > 100:
        return None
    if found[-1] in NUMBER_WORDS:
        return NUMBER_WORDS[found[-1]]
    value = Fraction(found[-1])
    return int(value) if value.denominator == 1 else None  # '4.5' is no count

def parse_roles(text, names):
    """{name: 'knight' | 'knave'} for each name the text gives a role, in any phrasing the prompt allows:
    '(1) Zoey is a knight', 'Zoey: knave', 'Zoey is not a knight' (a knave)."""
    roles = {}
    for name in names:
        match = re.search(rf"\b{re.escape(name)}\b([^.\n;,]*?)\b(knight|knave)s?\b", text, re.IGNORECASE)
        if match:
            role = match[2].lower()
            if re.search(r"\bnot\b", match[1], re.IGNORECASE):
                role = "knave" if role == "knight" else "knight"
            roles[name.lower()] = role
    return roles

def reference_roles(answer):
    """'(1) Zoey is a knight\n(2) Ethan is a knave' -> {'zoey': 'knight', 'ethan': 'knave'}."""
    return {name.lower(): role.lower() for name, role in re.findall(r"([A-Z][\w-]*) is an? (knight|knave)", answer)}

MATH_VERIFY_SECONDS = 2  # math-verify stops parsing or comparing one answer after this; whole seconds (SIGALRM)

def latex_equal(text, answer):
    """Whether math-verify finds the LaTeX text equal to the reference: \\frac{1}{2} = 0.5 = 1/2, \\boxed{3} = 3,
    [2, 5) an interval, \\sqrt{2} = 2^{1/2}. An expression that takes longer than MATH_VERIFY_SECONDS is not equal."""
    if text is None:
        return False
    gold, given = parse_latex(answer), parse_latex(text)
    return bool(gold and given) and math_verify().verify(gold, given, timeout_seconds=MATH_VERIFY_SECONDS)

def parse_latex(text):
    """math-verify's reading of a LaTeX answer ([] when it finds none); it looks for LaTeX between $ signs."""
    return math_verify().parse(text if "$" in text else f"${text}$", parsing_timeout=MATH_VERIFY_SECONDS)

def math_verify():
    import math_verify  # imported when a math_latex answer is first compared: it takes sympy, a second to import

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a timeout is a wrong answer, not a page of its LaTeX
    return math_verify

def last_boxed(text):
    """The content of the last \\boxed{...}, braces balanced, or None."""
    start = text.rfind("\\boxed{")
    depth = 0
    for end in range(start + len("\\boxed"), len(text)) if start >= 0 else ():
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : end]
    return None

def task_correctness(predicted, completion, answer, task, partial_credit=False):
    """correctness for the tasks whose answers are no plain number; predicted: the text in the last <answer> tags."""
    if task == "math_latex":  # the answer in the tags, else the last \boxed{}, compared by math-verify
        return float(latex_equal(predicted if predicted is not None else last_boxed(completion), answer))
    if predicted is None:
        return 0.0
    if task == "knights_knaves":  # the set of (name, role) pairs, in any order
        reference = reference_roles(answer)
        given = parse_roles(predicted, reference)
        right = sum(given.get(name) == role for name, role in reference.items())
        return right / max(1, len(reference)) if partial_credit else float(right == len(reference) > 0)
    value = parse_count(predicted)  # count_words: a whole number, in digits or in words: "4", "four", "4 words"
    return float(value is not None and value == parse_count(answer))

def answer_parses(text, task):
    if task == "knights_knaves":  # a role claimed for someone, as the prompt phrases it; a bare 'knight' is no answer
        return bool(ROLE_CLAIM.search(text or ""))
    if task == "count_words":
        return parse_count(text) is not None
    if task == "math_latex":  # words parse too, as products of letters: an answer has a digit or a LaTeX command
        return bool(re.search(r"[0-9\\]", text or "")) and bool(parse_latex(text))
    return parse_number(text) is not None

MAX_REWARD = 1e18  # beyond it a group's spread squared overflows float32: its std is inf and every advantage 0

def check_finite(rewards, terms, completions, answers):
    bad = (~(rewards.abs() <= MAX_REWARD)).nonzero().flatten().tolist()  # 1e308 is a float64, inf in float32
    if bad:
        i = bad[0]
        raise RewardError(f"the reward of completion {completions[i][:300]!r} (answer {answers[i]!r}) is "
                          f"{rewards[i].item()}: a reward must be a finite float32 number within +-{MAX_REWARD:g} "
                          f"(beyond, a group's standard deviation overflows and its advantages are 0); its terms: "
                          f"{ {n: v[i].item() for n, v in terms.items()} }")
