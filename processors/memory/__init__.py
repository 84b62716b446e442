"""Long-term memory: distilled statements per user, embedded, searched with pgvector.

``chunking`` splits statements into ~400-character pieces on sentence boundaries,
``distil`` picks what is worth remembering, ``embedders`` turns text into 256-dimension
vectors (WordLlama offline, or an OpenAI-compatible ``/v1/embeddings``), ``store``
writes (idempotently) and searches the ``memories`` table, ``tool`` is the
``memory_search`` tool a model calls.
"""
