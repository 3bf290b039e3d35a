"""The tools and messages the tool-call tests share: two functions whose parameters are JSON
schemas (get_weather, add_note), a user's question, and a conversation in which the assistant
called one and the tool answered."""

from __future__ import annotations

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 8}},
    "required": ["text"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add_note": NOTE}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CONVERSATION = [
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def named(name: str) -> dict:
    """A tool_choice that names one function."""
    return {"type": "function", "function": {"name": name}}
