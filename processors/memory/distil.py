"""What is worth remembering from a finished run.

The demo rule (deterministic, no model): the sentences of the user's input that state
something about the user: they end with "." or "!" and contain a first-person word
("I", "I'm", "I've", "I'd", "my", "me", "mine", "we", "our", "ours"). "My sister lives
in Porto." is kept; "What is my name?", "The sky is blue." and "follow me" (no full
stop) are not.

In production the OpenAI handler asks the model for the statements (see
``processors/handlers/openai.py``); both paths end in :func:`statements_to_chunks`.
"""

from __future__ import annotations

import re

from koda_runtime.processors.memory.chunking import chunk, sentences

_FIRST_PERSON = re.compile(r"\b(i|i'm|i've|i'd|my|me|mine|we|our|ours)\b", re.IGNORECASE)


def demo_statements(user_text: str) -> list[str]:
    """The first-person statements of ``user_text`` (the rule above), in order."""
    return [s for s in sentences(user_text) if _FIRST_PERSON.search(s) and s.endswith((".", "!"))]


def statements_to_chunks(statements: list[str]) -> list[str]:
    """The statements joined and chunked (~400 characters, 80 overlap, sentence bounds)."""
    return chunk(" ".join(s.strip() for s in statements if s.strip()))
