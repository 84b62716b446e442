"""Text to 256-dimension vectors: WordLlama offline (default) or an OpenAI-compatible API.

WordLlama's 256-dimension weights and its tokenizer ship inside the ``wordllama``
wheel; :class:`WordLlamaEmbedder` loads those two files by path, so nothing is ever
fetched at run time (the library's own loader looks for the tokenizer in another
directory and would fall back to a download).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from koda_runtime.errors import HandlerError

DIMENSIONS = 256


@dataclass(frozen=True)
class Embedded:
    """The vectors of one embedding call, unit length, and what the call cost in tokens."""

    vectors: list[list[float]]
    model: str
    tokens: int


class Embedder(Protocol):
    name: str

    async def embed(self, texts: list[str]) -> Embedded: ...


def unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(x * x for x in vector))
    if norm == 0.0:
        raise HandlerError("the embedder returned a zero vector")
    return [x / norm for x in vector]


class WordLlamaEmbedder:
    """WordLlama L2 "supercat", 256 dimensions, from the files inside the wheel."""

    name = "wordllama-l2-supercat-256"

    def __init__(self) -> None:
        import wordllama
        from safetensors import safe_open
        from wordllama.inference import WordLlamaInference
        from wordllama.wordllama import WordLlama

        root = Path(wordllama.__file__).parent
        weights = root / "weights" / "l2_supercat_256.safetensors"
        tokenizer_file = root / "tokenizers" / "l2_supercat_tokenizer_config.json"
        for path in (weights, tokenizer_file):
            if not path.is_file():
                raise HandlerError(f"WordLlama file missing from the wheel: {path}")
        tokenizer = WordLlama.load_tokenizer(tokenizer_file, use_local_if_exists=True)
        with safe_open(str(weights), framework="np", device="cpu") as f:
            matrix = f.get_tensor("embedding.weight")
        self._model: Any = WordLlamaInference(matrix, tokenizer, binary=False)
        self._tokenizer = tokenizer

    def embed_sync(self, texts: list[str]) -> Embedded:
        if not texts:
            return Embedded([], self.name, 0)
        matrix = self._model.embed(texts, norm=True)
        tokens = sum(len(e.ids) for e in self._tokenizer.encode_batch(texts))
        return Embedded([[float(x) for x in row] for row in matrix], self.name, tokens)

    async def embed(self, texts: list[str]) -> Embedded:
        # Microseconds per text: cheaper inline than a thread hop for the usual handful.
        return self.embed_sync(texts)


class OpenAIEmbedder:
    """``POST {base_url}/v1/embeddings`` with ``dimensions=256``."""

    def __init__(
        self, base_url: str, api_key: str | None, model: str, timeout_s: float = 30.0
    ) -> None:
        self.name = model
        self._model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s
        )

    async def embed(self, texts: list[str]) -> Embedded:
        if not texts:
            return Embedded([], self.name, 0)
        try:
            resp = await self._client.post(
                "/v1/embeddings",
                json={"model": self._model, "input": texts, "dimensions": DIMENSIONS},
            )
        except httpx.HTTPError as exc:
            raise HandlerError(f"embeddings request failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise HandlerError(
                f"embeddings endpoint answered {resp.status_code}: {resp.text[:200]}"
            )
        body = resp.json()
        rows = sorted(body.get("data", []), key=lambda d: d.get("index", 0))
        vectors = [unit([float(x) for x in row["embedding"]]) for row in rows]
        if len(vectors) != len(texts) or any(len(v) != DIMENSIONS for v in vectors):
            raise HandlerError(
                f"embeddings endpoint returned {len(vectors)} vectors for {len(texts)} texts "
                f"(each must have {DIMENSIONS} dimensions)"
            )
        tokens = int((body.get("usage") or {}).get("prompt_tokens", 0))
        return Embedded(vectors, str(body.get("model", self._model)), tokens)

    async def aclose(self) -> None:
        await self._client.aclose()


_wordllama: WordLlamaEmbedder | None = None


def wordllama() -> WordLlamaEmbedder:
    """The process's one WordLlama (loading takes ~1 s and 30 MB)."""
    global _wordllama
    if _wordllama is None:
        _wordllama = WordLlamaEmbedder()
    return _wordllama
