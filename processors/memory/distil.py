"""What is worth remembering from a finished run.

The demo rule (deterministic, no model): the sentences of the user's input that state
something about the user: they end with "." or "!" and contain a first-person word
("I", "I'm", "I've", "I'd", "my", "me", "mine", "we", "our", "ours"). "My sister lives
in Porto." is kept; "What is my name?", "The sky is blue." and "follow me" (no full
stop) are not.

In production the OpenAI handler asks the model for the statements and their subjects
(see ``processors/handlers/openai.py``); both paths end in :func:`statements_to_chunks`.
Distilling runs after the run is ``done``, off its path (processors/memory/distiller.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from koda_runtime.processors.memory.chunking import chunk, sentences
from koda_runtime.processors.memory.truth import normalise_subject, subject_of

_FIRST_PERSON = re.compile(r"\b(i|i'm|i've|i'd|my|me|mine|we|our|ours)\b", re.IGNORECASE)


def demo_statements(user_text: str) -> list[str]:
    """The first-person statements of ``user_text`` (the rule above), in order."""
    return [s for s in sentences(user_text) if _FIRST_PERSON.search(s) and s.endswith((".", "!"))]


@dataclass(frozen=True)
class Statement:
    """One statement to remember and its subject key (None: none known)."""

    text: str
    subject: str | None = None


def statement(text: str, subject: str | None = None) -> Statement:
    """A statement with the given subject (normalised), else the one the rules find."""
    given = normalise_subject(subject) if subject else None
    return Statement(text.strip(), given if given is not None else subject_of(text))


def statements_to_chunks(statements: list[Statement]) -> list[Statement]:
    """Each statement on its own (a memory is one fact, so a newer one can replace it),
    a statement over ~400 characters cut into chunks (80 overlap, sentence bounds) that
    keep its subject."""
    return [
        Statement(piece, s.subject) for s in statements if s.text.strip() for piece in chunk(s.text)
    ]
