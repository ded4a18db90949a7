"""Function calling (OpenAI's `tools` and `tool_choice`) as a prompt and a grammar.

The model is shown the functions (through its chat template where the template takes `tools`, else in a system
message, `SYSTEM`) and asked to call one as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
Hermes/Qwen convention many chat models were trained on). A grammar (constraints.py) then holds the output to
that form, each call's arguments valid against its function's `parameters` schema:

  auto       free text, or a call (text that begins with `<tool_call>` is a call)
  required   a call
  {"type": "function", "function": {"name": f}}   calls of f
  none       no grammar and no functions shown: the model answers in text

One call per reply unless `parallel_tool_calls` is true (OpenAI's default is true: sent as a default it would let
a small model repeat its call until the token limit, as SmolLM2-135M does, so entmtp asks for it explicitly). The wrapper and each call's `"name"` key are forced tokens, which
the engine drafts for free (engine.forced_step). `parse` reads the calls back for the reply's `tool_calls`;
`history` writes earlier calls and their results (role "tool") into the messages the template renders.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .constraints import JSON_OPTIONS, Constraint, ConstraintError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
SYSTEM = (
    "You can call functions. Each is given as JSON: its name, what it does, and the JSON Schema of its "
    'arguments.\n{functions}\n\nTo call a function, answer with <tool_call>{{"name": <the function\'s name>, '
    '"arguments": <its arguments as a JSON object>}}</tool_call> and nothing else.{rule}'
)
RULES = {
    "auto": " If no function helps, answer the user in plain text.",
    "required": " You must call a function.",
}


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: str  # the arguments' JSON Schema, as JSON text (hashable)

    def spec(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": json.loads(self.parameters),
            },
        }


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Tools:
    """A request's functions and the rule for calling them (`of` checks them)."""

    functions: tuple[Function, ...]
    choice: str  # "auto" | "required" | a function's name
    parallel: bool = False

    @classmethod
    def of(cls, tools, tool_choice=None, parallel_tool_calls: bool | None = None) -> Tools | None:
        """The request's tools (None: none given, or tool_choice "none"); ConstraintError names what is wrong."""
        if tool_choice is not None and tools is None:
            if tool_choice in ("none", "auto"):
                return None
            raise ConstraintError(
                "tool_choice names a call but no tools were given: send tools too", "tool_choice"
            )
        if not tools:
            return None
        if not isinstance(tools, Sequence) or isinstance(tools, str):
            raise ConstraintError('tools must be a list of {"type": "function", "function": {...}}')
        functions = tuple(_function(t, i) for i, t in enumerate(tools))
        names = [f.name for f in functions]
        if len(set(names)) < len(names):
            raise ConstraintError("tools: two functions have the same name: give each its own")
        choice = _choice(tool_choice, names)
        return None if choice == "none" else cls(functions, choice, parallel_tool_calls is True)

    @property
    def called(self) -> tuple[Function, ...]:
        """The functions the output may call."""
        return (
            self.functions
            if self.choice in ("auto", "required")
            else tuple(f for f in self.functions if f.name == self.choice)
        )

    def call_schema(self) -> dict:
        """The JSON Schema of one call: the name of a function the output may call and its arguments."""
        return {"anyOf": [_call_schema(f) for f in self.called]}

    def constraint(self) -> Constraint:
        """The grammar of the output (the module docstring)."""
        calls = {**self.call_schema(), "x-guidance": JSON_OPTIONS}
        call = f'"{OPEN}" %json {json.dumps(calls)} "{CLOSE}"'
        calls_rule = "call" if not self.parallel else 'call ("\\n" call)*'
        grammar = f"start: {calls_rule}\ncall: {call}\n"
        if self.choice == "auto":  # text that is not a call, or calls
            grammar = (
                f"start: {calls_rule} | TEXT\ncall: {call}\nTEXT: /(?s:.+)/ & ~/(?s:{re.escape(OPEN)}.*)/\n"
            )
        return Constraint.lark(grammar)

    def messages(self, messages: list[dict], tokenizer) -> tuple[list[dict], dict]:
        """(messages, apply_chat_template's extra keywords): the functions shown to the model, through the
        template when it takes `tools`, else in the system message."""
        specs = [f.spec() for f in self.functions]
        template = getattr(tokenizer, "chat_template", None) or ""
        if "tools" in template:
            return messages, {"tools": specs}
        rule = RULES.get(self.choice, f" You must call {self.choice}.")
        text = SYSTEM.format(functions="\n".join(json.dumps(s["function"]) for s in specs), rule=rule)
        if messages and messages[0]["role"] in ("system", "developer"):
            first = {"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}
            return [first, *messages[1:]], {}
        return [{"role": "system", "content": text}, *messages], {}

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls `text` makes (None: it is a text answer, or calls cut short by the token limit)."""
        if not text.startswith(OPEN):
            return None
        calls = []
        for part in text.split("\n"):
            if not (part.startswith(OPEN) and part.endswith(CLOSE)):
                return None
            try:
                call = json.loads(part[len(OPEN) : -len(CLOSE)])
            except json.JSONDecodeError:
                return None
            calls.append(
                ToolCall(f"call_{uuid.uuid4().hex[:24]}", call["name"], json.dumps(call["arguments"]))
            )
        return calls


def call_text(name: str, arguments) -> str:
    """A call as the model writes it (an assistant message's earlier `tool_calls`, `history`)."""
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"{OPEN}{json.dumps({'name': name, 'arguments': args}, separators=(',', ':'))}{CLOSE}"


def history(messages: list[Mapping]) -> list[dict]:
    """OpenAI messages as the chat template renders them: an assistant's `tool_calls` as the calls' text, a
    tool's result as a "tool" turn (its content as given)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]
            )
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
    return out


def _function(tool, i: int) -> Function:
    where = f"tools[{i}]"
    if (
        not isinstance(tool, Mapping)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), Mapping)
    ):
        raise ConstraintError(
            f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}'
        )
    f = tool["function"]
    name = f.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ConstraintError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}")
    parameters = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        raise ConstraintError(f"{where}.function.parameters must be a JSON Schema object")
    Constraint.json_schema(parameters)  # a schema that cannot be enforced is named here
    return Function(name, str(f.get("description") or ""), json.dumps(parameters, sort_keys=True))


def _choice(tool_choice, names: list[str]) -> str:
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    if isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        if name in names:
            return name
        raise ConstraintError(
            f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)})", "tool_choice"
        )
    raise ConstraintError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _call_schema(f: Function) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, "arguments": json.loads(f.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
