"""Which memories stay true: a statement's subject, and when two statements are one.

Two rules decide what a new statement does to a user's current memories (of the same
embedder; processors/memory/store.py applies them under a per-user lock):

* **Duplicate**: the same text (case and spaces folded), or a cosine score of at least
  the embedder's :data:`DUPLICATE_SCORES` entry, unless both statements have a subject
  and the subjects differ, or their words holding digits differ (:func:`numbers`). A
  duplicate adds no row; the kept one's ``said_at`` moves to the later of the two. An
  embedder with no calibrated entry dedupes by text only.
* **Supersedes**: both have a subject, the subjects are equal and the statements are not
  duplicates. The one said later (``said_at``: the run's creation time, so a run
  distilled late does not win over a newer one) is current; the other is kept with
  ``superseded_by`` for audit and never searched.

The subject is a short key naming what a statement is about (``home``, ``occupation``,
``favourite colour``, ``sister home``...). The model's distillation may give it;
otherwise :func:`subject_of` finds it with the rules below, for first-person ("I live
in Lisbon.") and third-person ("The user lives in Lisbon.") statements. No subject: the
statement can be a duplicate but never supersedes nor is superseded.

The thresholds and the rules are measured on tests/memory_truth_corpus.py (labelled
pairs); tests/integration/test_memory_truth.py prints precision and recall.
"""

from __future__ import annotations

import re

# Cosine score from which two statements are the same fact, per embedder name. WordLlama
# on tests/memory_truth_corpus.py: paraphrases of one fact score 0.888-1.0 (one outlier
# at 0.819), two facts at most 0.848 ("I live in Lisbon." / "I work in Lisbon."), the same
# subject with another value at most 0.755: 0.87 sits in the gap.
DUPLICATE_SCORES: dict[str, float] = {"wordllama-l2-supercat-256": 0.87}


def duplicate_score(embedder: str) -> float | None:
    """The embedder's calibrated duplicate score; None: dedupe by text only."""
    return DUPLICATE_SCORES.get(embedder)


SUBJECT_CHARS = 60

_PEOPLE = (
    "wife|husband|partner|girlfriend|boyfriend|fiance|fiancee|son|daughter|sister|brother|"
    "mother|father|mum|mom|dad|mother-in-law|father-in-law|grandmother|grandfather|"
    "grandma|grandpa|aunt|uncle|cousin|niece|nephew|friend|best friend|boss|manager|"
    "colleague|neighbour|neighbor|flatmate|roommate|dog|cat|child|kid|baby|teacher|doctor"
)
_JOBS = (
    "engineer|developer|programmer|teacher|doctor|nurse|lawyer|designer|chef|student|"
    "accountant|manager|scientist|architect|journalist|pilot|dentist|pharmacist|"
    "consultant|analyst|researcher|writer|translator|electrician|plumber|photographer|"
    "musician|artist|professor|lecturer|banker|farmer|carpenter|mechanic|librarian|"
    "firefighter|police officer|software engineer|data engineer|data scientist"
)
_ME = r"(?:i|the user|user)"
_NOW = r"(?:now |currently |recently |just |still |also )*"
_MOVE = (
    r"(?:lives?|am living|is living|resides?|am based|is based|(?:have|has) moved|moved|"
    r"(?:have|has) relocated|relocated|(?:am|is) moving|stays?|am staying|is staying)"
)

# (pattern, subject): the first that matches names the subject; ``{x}`` is the
# pattern's group "x" (a relative, a pet, a thing).
_OF = r"^(?:my|the user's)"
_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), s)
    for p, s in (
        (rf"^(?:my|the user's) (?P<x>{_PEOPLE})(?: \w+)? {_NOW}{_MOVE} (?:in|to)\b", "{x} home"),
        (rf"^(?:my|the user's) (?P<x>{_PEOPLE})(?: \w+)? {_NOW}works? as\b", "{x} occupation"),
        (rf"{_OF} (?P<x>{_PEOPLE})(?: \w+)? {_NOW}works? (?:at|for)\b", "{x} employer"),
        (
            rf"^(?:my|the user's) (?P<x>{_PEOPLE})(?: \w+)? (?:is|was) {_NOW}(?:a|an) "
            rf"(?:\w+ )?(?:{_JOBS})\b",
            "{x} occupation",
        ),
        (
            rf"^(?:my|the user's) (?P<x>{_PEOPLE})(?: \w+)? (?:is|are) {_NOW}(?:called|named)\b",
            "{x} name",
        ),
        (rf"^(?:my|the user's) (?P<x>{_PEOPLE})(?:'s| s) name is\b", "{x} name"),
        (rf"^{_ME} {_NOW}{_MOVE} (?:in|to)\b", "home"),
        (r"^(?:my|the user's) (?:home|home town|hometown|home city|address) is\b", "home"),
        (rf"^{_ME} (?:am|is) {_NOW}from\b", "origin"),
        (rf"^{_ME} {_NOW}works? as\b", "occupation"),
        (r"^(?:my|the user's) (?:job|profession|occupation|role) is\b", "occupation"),
        (rf"^{_ME} (?:am|is) {_NOW}(?:a|an) (?:\w+ )?(?:{_JOBS})\b", "occupation"),
        (rf"^{_ME} {_NOW}works? (?:at|for)\b", "employer"),
        (r"^(?:my|the user's) (?:employer|company) is\b", "employer"),
        (
            rf"^{_ME} (?:am|is|became|(?:have|has) become) {_NOW}(?:a |an )?"
            r"(?:vegetarian|vegan|pescatarian|carnivore|omnivore|flexitarian)\b",
            "diet",
        ),
        (rf"^{_ME} {_NOW}(?:(?:do not|does not|don't|doesn't|no longer) )?eats? meat\b", "diet"),
        (
            rf"^{_ME} (?:am|is|got) {_NOW}(?:single|married|divorced|engaged|widowed)\b",
            "relationship",
        ),
        (rf"^{_ME} (?:am|is|turned) {_NOW}\d+(?: years old)?\b", "age"),
        (rf"^{_ME} {_NOW}drives?\b", "car"),
        (rf"^{_ME} {_NOW}prefers? (?:tea|coffee)\b", "hot drink"),
        (r"^(?:my|the user's) name is\b", "name"),
        (rf"^{_ME} (?:am|is) called\b", "name"),
        (
            r"^(?:my|the user's) (?P<thing>(?:[a-z-]+ ){0,2}[a-z-]+) (?:is|are) ",
            "{thing}",
        ),
    )
)

_PERSON = re.compile(rf"(?:^| )(?:{_PEOPLE})$")
_SPELLING = (("favorite", "favourite"), ("color", "colour"))


def _fold(statement: str) -> str:
    text = " ".join(statement.lower().replace("\u2019", "'").split())
    text = text.replace("i'm ", "i am ").replace("i've ", "i have ").replace("'re ", " are ")
    text = re.sub(r"^(?:the user|user) is ", "the user is ", text)
    for us, uk in _SPELLING:
        text = re.sub(rf"\b{us}\b", uk, text)
    return text.rstrip(".! ")


def normalise_subject(subject: str) -> str | None:
    """The form subjects are compared in: lower case, spaces folded, British spelling,
    at most :data:`SUBJECT_CHARS` characters; None for an empty one."""
    text = " ".join(subject.lower().replace("_", " ").split())
    for us, uk in _SPELLING:
        text = re.sub(rf"\b{us}\b", uk, text)
    text = text.replace("'s ", " ").strip(" .")
    return text[:SUBJECT_CHARS] or None


def subject_of(statement: str) -> str | None:
    """The subject of one statement by the rules above, or None."""
    text = _fold(statement)
    for pattern, subject in _RULES:
        match = pattern.search(text)
        if match is None:
            continue
        groups = match.groupdict()
        if _PERSON.search(groups.get("thing") or ""):
            return None  # "my wife is kind": a person is no subject, what about them is
        found = subject.format(**groups) if "{" in subject else subject
        return normalise_subject(found)
    return None


_NUMBERED = re.compile(r"[\w-]*\d[\w-]*")
_ORDINAL = re.compile(r"(?<=\d)(?:st|nd|rd|th)\b")


def numbers(statement: str) -> frozenset[str]:
    """The words of a statement that hold a digit ("1980", "k-77", "14th" as "14"):
    statements that differ in them are never duplicates, however close their vectors
    (embedders place "my PIN is 4821" and "my PIN is 1357" side by side)."""
    return frozenset(_NUMBERED.findall(_ORDINAL.sub("", statement.lower())))


def is_duplicate(
    score: float | None,
    same_text: bool,
    subject: str | None,
    other_subject: str | None,
    threshold: float | None,
    same_numbers: bool = True,
) -> bool:
    """The duplicate rule for one pair (``score``: their cosine, None when not
    comparable; ``same_numbers``: their :func:`numbers` are equal)."""
    if same_text:
        return True
    if not same_numbers:
        return False
    if subject is not None and other_subject is not None and subject != other_subject:
        return False
    return threshold is not None and score is not None and score >= threshold


def supersedes(subject: str | None, other_subject: str | None) -> bool:
    """Whether two statements that are not duplicates are about the same subject."""
    return subject is not None and subject == other_subject
