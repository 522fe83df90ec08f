"""Tool calling, the request side (pure functions, no I/O): a chat request's `tools`, its `tool_choice`,
the JSON schema that `required` and a named choice constrain the output to, and the tool-calling fields
of its messages, checked as vLLM's OpenAI server checks them.

    tools:        [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    tool_choice:  "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}

Every tool reaches the chat template (`tokenizer.apply_chat_template(..., tools=...)`), which renders
them into the prompt as the model was trained to read them; what the choice changes is the output:

- none: the output is not parsed (free text, as without tools);
- auto (the default when tools are given): generation is untouched, and the text is parsed for tool
  calls in the format the server's `--tool-call-parser` names (`specula.serve.tool_calls`): hermes's
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, llama3_json's `{"name": ...,
  "parameters": {...}}` objects separated by `;`, mistral's `[TOOL_CALLS]` and its calls (tags that the
  tokenizer makes special tokens are kept in the text for the parser), or pythonic's Python list of calls
  `[name(key=<literal>, ...), ...]` (llama4_pythonic's too, Llama 4's `<|python_start|>` and `<|python_end|>`
  around it dropped). As in vLLM, the server must be
  started with `--enable-auto-tool-choice --tool-call-parser <parser>`;
- required: the output is constrained (`Constraint.json_schema`) to a JSON list of at least one
  `{"name": <a tool's name>, "parameters": <its parameters>}` (vLLM's schema), turned into tool calls;
- named: the output is constrained to the named tool's parameters schema and becomes its arguments.

Problems are `ToolError`s naming the field; the server answers them 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from specula.constraints import Constraint, ConstraintError
from specula.errors import ConfigError
from specula.methods import article

ToolChoice = Literal["none", "auto", "required", "named"]

TOOL_PARSERS = ("hermes", "llama3_json", "llama4_pythonic", "mistral", "pythonic")
"""The output formats `--tool-call-parser` can parse for tool_choice auto (vLLM's names)."""

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The schema of a tool that gives no parameters (vLLM's: its arguments are an object, `{}` when empty)."""

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
"""vLLM's hint after a malformed named tool_choice."""


def auto_tool_parser(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> str | None:
    """The parser of tool_choice auto's output that the server's `--enable-auto-tool-choice` and
    `--tool-call-parser` give (None: auto is off), checked as vLLM checks them (a ConfigError naming
    `ServerConfig`'s fields, which the commands show as their flags)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ConfigError(f"tool_call_parser {tool_call_parser!r} is not one this server has; choose "
                          f"{', '.join(TOOL_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ConfigError(f"enable_auto_tool_choice needs tool_call_parser, one of {', '.join(TOOL_PARSERS)}: the "
                          'format the model writes its tool calls in (e.g. tool_call_parser="hermes")')
    return tool_call_parser if enable_auto_tool_choice else None


class ToolError(ValueError):
    """A request's tools, tool_choice or tool-calling messages given wrong: `param` names the field,
    `code` says how (OpenAI's "invalid_type", "invalid_value" or "unsupported_parameter")."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what its output may do with them."""

    tools: tuple[dict[str, Any], ...]
    """The tools as the chat template reads them (`{"type": "function", "function": {...}}`)."""
    choice: ToolChoice
    """none: output not parsed; auto: parsed for tool calls (hermes); required: constrained to a list of
    calls; named: constrained to the arguments of the tool `name`."""
    name: str | None = None
    """The tool a named choice calls (None otherwise)."""
    parallel: bool = True
    """`parallel_tool_calls`: False keeps the first tool call of an output only (as vLLM does)."""
    parser: str = "hermes"
    """The format tool_choice auto's output is parsed in (one of `TOOL_PARSERS`; read for auto only)."""

    def parameters(self, name: str) -> dict[str, Any]:
        """The parameters schema of the tool `name` (an empty object's when it gives none)."""
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return function.get("parameters") or EMPTY_PARAMETERS

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is constrained to (vLLM's): required, a list of at least one call of
        any tool, the tools' `$defs` gathered at its root (where their `$ref`s point); named, that tool's
        parameters; None for none and auto (the output is free)."""
        if self.choice == "named":
            return self.parameters(self.name)
        if self.choice != "required":
            return None
        defs: dict[str, Any] = {}
        calls = []
        for tool in self.tools:
            parameters = dict(tool["function"].get("parameters") or EMPTY_PARAMETERS)
            for key, definition in parameters.pop("$defs", {}).items():
                if defs.setdefault(key, definition) != definition:
                    raise ToolError(f"Tool definition '{key}' has multiple schemas, which is not supported: give "
                                    "the tools' $defs different names", "tools")
            calls.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                         "parameters": parameters}, "required": ["name", "parameters"]})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
        if defs:
            schema["$defs"] = defs
        return schema

    def constraint(self) -> Constraint | None:
        """`schema()` as the request's constraint (compiled: a ToolError with the library's reason when it
        cannot be)."""
        schema = self.schema()
        if schema is None:
            return None
        try:
            constraint = Constraint.json_schema(schema)
            constraint.grammar_text()
        except ConstraintError as exc:
            raise ToolError(f"the tools' parameters cannot constrain tool_choice {self.label}: {exc}",
                            "tools") from None
        return constraint

    @property
    def label(self) -> str:
        """The choice as the request gave it, for messages."""
        return json.dumps(self.name) if self.choice == "named" else self.choice


def parse_tools(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    """The request's `tools` (none: `()`), each checked: `{"type": "function", "function": {"name": a
    non-empty string, "description": a string, "parameters": a JSON schema object, "strict": a
    boolean}}`. Passed on as given, for the template."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise ToolError(f"'tools' must be a list of {{'type': 'function', 'function': {{...}}}} objects, got "
                        f"{_json(tools)}", "tools", "invalid_type")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(f"'{where}' must be an object {{'type': 'function', 'function': {{'name': ...}}}}, got "
                            f"{_json(tool)}", where, "invalid_type")
        if tool.get("type", "function") != "function":
            raise ToolError(f"'{where}.type' must be 'function' (the only tool type of chat completions), got "
                            f"{_json(tool.get('type'))}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"'{where}.function' must be an object with a 'name', got {_json(function)}",
                            f"{where}.function", "invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"'{where}.function.name' must be a non-empty string, got {_json(name)}",
                            f"{where}.function.name", "invalid_type")
        for key, kind, expected in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                    ("strict", bool, "a boolean")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise ToolError(f"'{where}.function.{key}' must be {expected}, got {_json(function[key])}",
                                f"{where}.function.{key}", "invalid_type")
    return tuple({**tool, "type": "function"} for tool in tools)


def parse_tool_use(body: Mapping[str, Any], tool_parser: str | None) -> ToolUse | None:
    """A chat request's tools and tool_choice (None: no tools, and a tool_choice of none or auto, which
    then mean nothing). vLLM's rules: tool_choice defaults to "auto" when tools are given; "required" and
    a named choice need tools (a named one, one of them); "auto" with tools needs the server's
    `tool_parser` (`--enable-auto-tool-choice --tool-call-parser PARSER`, one of `TOOL_PARSERS`)."""
    tools = parse_tools(body)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    name = None
    if isinstance(choice, dict):
        name = _named_choice(choice)
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise ToolError(f"Invalid value for `tool_choice`: {_json(choice)}! Only named tools, \"none\", \"auto\" or "
                        "\"required\" are supported.", "tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(f"'parallel_tool_calls' must be a boolean, got {_json(parallel)}", "parallel_tool_calls",
                        "invalid_type")
    if not tools:
        if choice in ("none", "auto"):
            return None
        raise ToolError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise ToolError(f"The tool specified in `tool_choice` ({json.dumps(name)}) does not match any of the "
                        "specified `tools`", "tool_choice")
    if choice == "auto" and tool_parser is None:
        raise ToolError("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set "
                        "(start the server with `--enable-auto-tool-choice --tool-call-parser hermes`, or llama3_json, "
                        "llama4_pythonic, mistral or pythonic: the format the model writes its calls in), or give "
                        "tool_choice \"none\", \"required\" or a named tool", "tool_choice")
    return ToolUse(tools, choice, name, parallel is not False, tool_parser or "hermes")


def _named_choice(choice: dict[str, Any]) -> str:
    """The tool a named tool_choice names (vLLM's checks and messages)."""
    if choice.get("type", "function") != "function":
        raise ToolError(f"Invalid value for `type`: {_json(choice.get('type'))} in `tool_choice`! {_NAMED_USAGE}",
                        "tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"Invalid value for `function`: `{_json(function)}` in `tool_choice`! {_NAMED_USAGE}",
                        "tool_choice")
    if "name" not in function:
        raise ToolError(f"Expected field `name` in `function` in `tool_choice`! {_NAMED_USAGE}", "tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ToolError(f"Invalid `name` in `function`: `{_json(name)}` in `tool_choice`! {_NAMED_USAGE}",
                        "tool_choice")
    return name


def template_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """A checked chat message (`prompts.chat_message`) as the server gives it to the template: its role and
    content, an assistant's `tool_calls` (each `{"id", "type": "function", "function": {"name",
    "arguments"}}`, the arguments' JSON text parsed into an object, as vLLM passes them: tool-calling
    templates write them out as JSON) and a tool message's `tool_call_id` (optional, as in vLLM)."""
    out: dict[str, Any] = {"role": message["role"], "content": message["content"]}
    where = f"messages[{index}]"
    calls = message.get("tool_calls")
    if calls is not None:
        if message["role"] != "assistant":
            raise ToolError(f"'{where}.tool_calls' is only allowed on an assistant message, not "
                            f"{_a_role(message['role'])} one", f"{where}.tool_calls", "invalid_value")
        if not isinstance(calls, list):
            raise ToolError(f"'{where}.tool_calls' must be a list of tool calls, got {_json(calls)}",
                            f"{where}.tool_calls", "invalid_type")
        out["tool_calls"] = [_history_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if message["role"] != "tool":
            raise ToolError(f"'{where}.tool_call_id' is only allowed on a tool message, not "
                            f"{_a_role(message['role'])} one", f"{where}.tool_call_id", "invalid_value")
        if not isinstance(call_id, str):
            raise ToolError(f"'{where}.tool_call_id' must be the id of the tool call this message answers (a "
                            f"string), got {_json(call_id)}", f"{where}.tool_call_id", "invalid_type")
        out["tool_call_id"] = call_id
    return out


def _history_call(call: Any, where: str) -> dict[str, Any]:
    """One tool call of an earlier assistant message, for the template."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ToolError(f"'{where}' must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}, got "
                        f"{_json(call)}", where, "invalid_type")
    if call.get("type", "function") != "function":
        raise ToolError(f"'{where}.type' must be 'function', got {_json(call.get('type'))}", f"{where}.type")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise ToolError(f"'{where}.id' must be a string, got {_json(call['id'])}", f"{where}.id", "invalid_type")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"'{where}.function.name' must be a non-empty string, got {_json(name)}",
                        f"{where}.function.name", "invalid_type")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise ToolError(f"'{where}.function.arguments' must be JSON text (the arguments object, as a response's "
                            f"tool call gives it): {exc}", f"{where}.function.arguments") from None
    elif not isinstance(arguments, dict):
        raise ToolError(f"'{where}.function.arguments' must be JSON text or an object, got {_json(arguments)}",
                        f"{where}.function.arguments", "invalid_type")
    return {**call, "type": "function", "function": {**function, "arguments": arguments}}


def _a_role(role: Any) -> str:
    """A message's role quoted, after its article (`methods.article`): "an 'assistant'", "a 'tool'", "a 'user'"."""
    return f"{article(str(role))} {role!r}"


def _json(value: Any) -> str:
    try:
        return json.dumps(value)[:80]
    except (TypeError, ValueError):
        return repr(value)[:80]
