"""Helpers for the tool-calling tests: tools, and a word-level chat template that renders them (and the
tool-calling fields of messages) into the prompt."""

from __future__ import annotations

from serve_helpers import make_tokenizer

TOOL_TEMPLATE = (
    "{% if tools %}{% for t in tools %}w05 {{ t.function.name }} {% endfor %}{% endif %}"
    "{% for m in messages %}w02 {{ m['content'] }} "
    "{% for c in m.tool_calls or [] %}w08 {{ c.function.name }} {{ c.function.arguments.arg }} {% endfor %}"
    "{% if m.tool_call_id %}w09 {{ m.tool_call_id }} {% endif %}w03 {% endfor %}"
    "{% if add_generation_prompt %}w04{% endif %}"
)
"""Renders each tool's name (words w00..w95), an assistant's tool calls (the arguments object's `arg`, so
a call's JSON arguments must have been parsed) and a tool message's tool_call_id."""


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "description": f"the tool {name}"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool("w07", {"type": "object", "properties": {"arg": {"type": "string"}}}), tool("w11")]


def tool_tokenizer():
    """The server tests' word-level tokenizer with `TOOL_TEMPLATE`."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer
