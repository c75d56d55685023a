"""``/v1/embeddings`` request and response schemas (pydantic), OpenAI's shape.

``pooling`` and ``normalize`` are extensions (vLLM's ``normalize``); the server's config chooses the pooling
when a request does not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mcp2026.serve.protocol import TokenIds


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling: Literal["last", "mean"] | None = None  # None: the server's embedding_pooling
    normalize: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        """One clear message per wrong shape (pydantic's own would list every member of the union)."""
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be an empty string")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"input must be a string or a non-empty list, got {_kind(value)}")
        if all(isinstance(v, str) for v in value):
            if not all(value):
                raise ValueError("input must not hold an empty string")
        elif all(isinstance(v, list) for v in value):
            for i, ids in enumerate(value):
                _check_token_ids(ids, f"input[{i}]")
        else:
            _check_token_ids(value, "input")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The batch: one string, a list of strings, one id list or a list of id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(x, int) for x in value):
            return [list(value)]
        return list(value)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 (encoding_format "base64")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


def _check_token_ids(ids: list[Any], name: str) -> None:
    if not ids:
        raise ValueError(f"{name} must not be an empty token-id list")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 31:
            raise ValueError(
                f"{name} holds {t!r}, not a token id (an integer in [0, 2**31)); input takes a string, a list of "
                "strings, a list of token ids or a list of token-id lists"
            )
