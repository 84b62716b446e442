"""``memory_search``: the built-in tool a model calls to recall what the user told it.

The user is the run's user, passed by the worker; it is not a parameter, and an
argument that tries to name one is refused. Every answer is text for the model:
results with their scores, an explicit "nothing found, do not guess", or a validation
error that names the field, the allowed range and an example.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from koda_runtime.errors import HandlerError, KodaError
from koda_runtime.processors.memory.embedders import Embedded, Embedder
from koda_runtime.schemas import memories

log = logging.getLogger(__name__)

NAME = "memory_search"
DEFAULT_LIMIT = 5
MAX_LIMIT = 10
# WordLlama cosine: a labelled fact scores 0.15 at its 10th percentile, unrelated ones
# 0.10 at their 90th (tests/memory_corpus.py).
MIN_SCORE = 0.1

DEFINITION: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": (
            "Search what this user told you in earlier conversations (their long-term "
            "memory). Returns the most relevant remembered statements with a relevance "
            "score. Only this user's memories are searched."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "description": (
                        "A short retrieval phrase you write describing the fact you need, "
                        "not the user's whole message. Example: \"user's home city\"."
                    ),
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": MAX_LIMIT,
                    "default": DEFAULT_LIMIT,
                    "description": f"How many memories to return, 1 to {MAX_LIMIT}.",
                },
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}


class ToolArgumentError(KodaError, ValueError):
    """The model's arguments are invalid; the message is what the model is told."""


@dataclass(frozen=True)
class SearchArgs:
    query: str
    limit: int


def parse_args(raw: str) -> SearchArgs:
    """Validate the model's JSON arguments, raising ToolArgumentError with the fix."""
    example = '{"query": "user\'s home city", "limit": 5}'
    try:
        args = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as exc:
        raise ToolArgumentError(
            f"memory_search arguments are not valid JSON ({exc.msg}); example: {example}"
        ) from exc
    except (RecursionError, ValueError) as exc:  # nested too deep; a number too long
        raise ToolArgumentError(
            f"memory_search arguments cannot be read ({type(exc).__name__}); example: {example}"
        ) from exc
    if not isinstance(args, dict):
        raise ToolArgumentError(
            f"memory_search arguments must be a JSON object; example: {example}"
        )
    unknown = sorted(set(args) - {"query", "limit"})
    if unknown:
        raise ToolArgumentError(
            f"memory_search has no field {', '.join(map(repr, unknown))}: it takes only "
            f"'query' and 'limit', and always searches the current user's memories; "
            f"example: {example}"
        )
    query = args.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ToolArgumentError(
            f"field 'query' is required: a non-empty retrieval phrase; example: {example}"
        )
    limit = args.get("limit", DEFAULT_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ToolArgumentError(
            f"field 'limit' must be an integer from 1 to {MAX_LIMIT} (got {limit!r}); "
            f'example: {{"query": "{query.strip()[:40]}", "limit": {DEFAULT_LIMIT}}}'
        )
    return SearchArgs(query.strip()[:1000], limit)


@dataclass(frozen=True)
class ToolResult:
    content: str
    embedded: Embedded | None
    ok: bool


UNAVAILABLE = (
    "error: memory_search is unavailable right now. Answer without the user's memories; "
    "do not guess what they might have said."
)

EMPTY = (
    "No memories matched this query: the user has not told you this (or it was forgotten). "
    "Do not guess; say you do not know, or ask the user."
)


async def memory_search(
    raw_args: str,
    *,
    user_id: str,
    engine: AsyncEngine,
    embedder: Embedder,
    min_score: float = MIN_SCORE,
    plan: memories.Plan = memories.DEFAULT_PLAN,
) -> ToolResult:
    """Run the tool for the run's ``user_id``; the answer is always text for the model."""
    try:
        args = parse_args(raw_args)
    except ToolArgumentError as exc:
        return ToolResult(f"error: {exc}", None, ok=False)
    try:
        embedded = await embedder.embed([args.query])
    except HandlerError as exc:
        log.warning("memory_search unavailable user_id=%s: %s", user_id, str(exc)[:300])
        return ToolResult(UNAVAILABLE, None, ok=False)
    hits = await memories.search(
        engine,
        user_id=user_id,
        embedder=embedder.name,
        vector=embedded.vectors[0],
        limit=args.limit,
        min_score=min_score,
        plan=plan,
    )
    if not hits:
        return ToolResult(EMPTY, embedded, ok=True)
    body = {"memories": [{"text": h.text, "score": round(h.score, 3)} for h in hits]}
    return ToolResult(json.dumps(body), embedded, ok=True)
