"""Function calling: the tools into the prompt, the structured-output constraint that guarantees a valid call
for ``tool_choice`` "required" or a named function, and the model's output parsed into OpenAI ``tool_calls``.

Output formats recognised with ``tool_choice="auto"``: Hermes/Qwen ``<tool_call>{...}</tool_call>``, Mistral
``[TOOL_CALLS][...]`` and Llama-3's bare ``{"name": ..., "parameters": ...}``. A chat template that does not
render tools itself gets them as a Hermes-style system message, so any model is told what it may call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mcp2026.serve.protocol import ChatCompletionRequest
from mcp2026.serve.protocol_structured import NamedToolChoice
from mcp2026.types import StructuredOutputs

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"


@dataclass(frozen=True)
class ToolPlan:
    """The tools of one chat request. ``mode``: "auto" | "required" | "named" (then ``name`` is the tool)."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """None when the request has no tools or ``tool_choice`` is "none" (the model then answers in text)."""
    if not req.tools or req.tool_choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if isinstance(req.tool_choice, NamedToolChoice):
        return ToolPlan(tools, "named", req.tool_choice.function.name, req.parallel_tool_calls)
    return ToolPlan(tools, req.tool_choice or "auto", None, req.parallel_tool_calls)


def template_inputs(
    plan: ToolPlan | None, messages: list[dict[str, Any]], chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` to render. A template that knows tools gets them as they are; for one that
    does not, earlier calls become ``<tool_call>`` text and the tools a system message."""
    if chat_template is not None and "tools" in chat_template:
        return messages, plan.tools if plan else None
    rendered = []
    for m in messages:
        m = dict(m)
        for call in m.pop("tool_calls", None) or ():
            arguments = call["function"]["arguments"]  # a client's string: kept as it is if it is not JSON
            parsed = _loads(arguments)
            body = {"name": call["function"]["name"], "arguments": arguments if parsed is None else parsed}
            m["content"] += f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>"
        if m.pop("tool_call_id", None) is not None:
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        rendered.append(m)
    if plan is None:
        return rendered, None
    signatures = "\n".join(json.dumps(t["function"]) for t in plan.tools)
    prompt = (
        "You may call one or more functions to assist with the user query. The function signatures are within "
        f"<tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\nFor each function call, return a json "
        'object with the function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def constraint(plan: ToolPlan | None) -> StructuredOutputs | None:
    """The grammar that guarantees a valid call: the named tool's parameters, or for "required" a non-empty
    JSON array of ``{"name", "parameters"}`` objects, one schema per tool (vLLM's shapes)."""
    if plan is None or plan.mode == "auto":
        return None
    params = {
        t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in plan.tools
    }
    if plan.mode == "named":
        return StructuredOutputs(json=json.dumps(params[plan.name], sort_keys=True))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
        }
        for name, schema in params.items()
    ]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not plan.parallel:
        array["maxItems"] = 1
    return StructuredOutputs(json=json.dumps(array, sort_keys=True))


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content left, OpenAI tool calls). Text that names no known tool, or whose arguments are not a JSON
    object, stays content: it is never turned into a call the client did not offer."""
    if plan.mode == "named":
        return None, [_call(plan.name or "", json.loads(text))]
    if plan.mode == "required":
        return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
    candidates: list[Any] = []
    content = text
    if "<tool_call>" in text:
        candidates = [_loads(body) for body in _HERMES.findall(text)]
        content = text[: text.index("<tool_call>")]
    elif text.lstrip().startswith(_MISTRAL):
        parsed = _loads(text.lstrip()[len(_MISTRAL) :])
        candidates, content = (parsed if isinstance(parsed, list) else [parsed]), ""
    elif text.lstrip().startswith("{"):
        candidates, content = [_loads(text)], ""
    calls = []
    for c in candidates:
        if not isinstance(c, dict) or c.get("name") not in plan.names:
            return text, []
        arguments = c.get("arguments", c.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        if not isinstance(arguments, dict):
            return text, []
        calls.append(_call(c["name"], arguments))
    if not calls:
        return text, []
    return (content.strip() or None), calls if plan.parallel else calls[:1]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
