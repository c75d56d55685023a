"""Request schemas of the constraint fields: ``response_format``, vLLM's ``structured_outputs``, and the
tools of a chat request (definitions, ``tool_choice``, the calls of earlier assistant turns)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mcp2026.types import StructuredOutputs


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


def constraint_of(kind: str, value: Any) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs(json=value if isinstance(value, str) else json.dumps(value, sort_keys=True))
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        if not value or any(not c for c in value):  # an empty alternative would let the output be empty
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return StructuredOutputs(choice=tuple(value))
    return StructuredOutputs(**{kind: value})


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self

    def spec(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:
            # an empty schema means any JSON object, as OpenAI treats it
            return constraint_of("json", self.json_schema.schema_ or {"type": "object"})
        return None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
