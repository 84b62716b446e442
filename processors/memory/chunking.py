"""Split text into chunks of about 400 characters on sentence boundaries, 80 of overlap."""

from __future__ import annotations

import hashlib
import re

CHUNK_CHARS = 400
OVERLAP_CHARS = 80

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """The sentences of ``text``, whitespace collapsed; a sentence over the chunk size is
    cut at word boundaries so no piece exceeds it."""
    out: list[str] = []
    for raw in _SENTENCE_END.split(" ".join(text.split())):
        sentence = raw.strip()
        while len(sentence) > CHUNK_CHARS:
            cut = sentence.rfind(" ", 0, CHUNK_CHARS)
            cut = cut if cut > 0 else CHUNK_CHARS
            out.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        if sentence:
            out.append(sentence)
    return out


def chunk(text: str, size: int = CHUNK_CHARS, overlap: int = OVERLAP_CHARS) -> list[str]:
    """Whole sentences packed up to ``size`` characters; each chunk after the first
    starts with the last sentences of the one before, up to ``overlap`` characters, so a
    fact that straddles a boundary is whole in at least one chunk."""
    parts = sentences(text)
    chunks: list[str] = []
    current: list[str] = []
    for sentence in parts:
        if current and len(" ".join([*current, sentence])) > size:
            chunks.append(" ".join(current))
            carry: list[str] = []
            for previous in reversed(current):
                if len(" ".join([previous, *carry])) > overlap:
                    break
                carry.insert(0, previous)
            current = carry if len(" ".join([*carry, sentence])) <= size else []
        current.append(sentence)
    if current:
        chunks.append(" ".join(current))
    return chunks


def normalise(text: str) -> str:
    """The form two texts are compared in for dedupe: case and whitespace folded."""
    return " ".join(text.lower().split())


def content_hash(text: str) -> str:
    """sha256 of the normalised text: the dedupe key, unique per user."""
    return hashlib.sha256(normalise(text).encode()).hexdigest()
