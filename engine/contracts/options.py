"""Options declared once: a msgspec Struct whose fields carry their help, bounds and choices.

    page_size: Annotated[int, Meta(ge=1, description="token slots per KV page")] = 16
    policy: Annotated[Literal["lpm", "fcfs"], Meta(description="waiting-queue order")] = "lpm"
    worker_threads: Annotated[int, Meta(ge=1, description="...")] | None = None

From that one declaration come the command-line flags (engine/commands/options.py: type,
choices, default and help), the checks of a value (``check_declared``: bounds and choices, as
sentences that name the flag) and the wire format (msgspec enforces the same bounds when a
child decodes its config). ``Meta(extra={"env": NAME})`` makes an environment variable the
flag's default; ``Meta(extra={"aliases": [...]})`` names other flags that set it. Rules that
tie several options together stay in the Struct's ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import inspect


@dataclass(frozen=True)
class Option:
    name: str  # the field
    kind: type  # int, float, str, bool or list (of str: the flag takes one or more values)
    help: str
    default: Any
    optional: bool  # None is allowed
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None  # inclusive
    maximum: float | None = None  # inclusive
    env: str | None = None  # environment variable that supplies the default
    aliases: tuple[str, ...] = ()  # other flags that set it (another engine's name)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_KINDS = {inspect.IntType: int, inspect.FloatType: float, inspect.StrType: str,
          inspect.BoolType: bool}


def declared_options(struct: type[msgspec.Struct]) -> list[Option]:
    """The options ``struct`` declares, in field order."""
    options = []
    for field in inspect.type_info(struct).fields:
        kind, optional, described = field.type, False, {}
        # Annotated[T, Meta] | None nests either way round: unwrap both layers
        while isinstance(kind, (inspect.Metadata, inspect.UnionType)):
            if isinstance(kind, inspect.UnionType):
                optional = any(isinstance(t, inspect.NoneType) for t in kind.types)
                (kind,) = [t for t in kind.types if not isinstance(t, inspect.NoneType)]
            else:
                described = {**described, **(kind.extra_json_schema or {}), **(kind.extra or {})}
                kind = kind.type
        choices = None
        if isinstance(kind, inspect.ListType):
            base = list
        elif isinstance(kind, inspect.LiteralType):
            choices = tuple(kind.values)
            base = type(choices[0])
        else:
            base = _KINDS[type(kind)]
        options.append(Option(
            name=field.name, kind=base, help=described.get("description", ""),
            default=None if field.required else field.default, optional=optional,
            choices=choices, minimum=getattr(kind, "ge", None), maximum=getattr(kind, "le", None),
            env=described.get("env"), aliases=tuple(described.get("aliases", ()))))
    return options


def check_declared(value: msgspec.Struct) -> None:
    """Raise ValueError, naming the flag, if a field of ``value`` is outside its declaration."""
    for option in declared_options(type(value)):
        given = getattr(value, option.name)
        if given is None and (option.optional or option.default is None):
            continue
        if option.choices is not None and given not in option.choices:
            allowed = ", ".join(str(c) for c in option.choices)
            raise ValueError(f"{option.flag} must be one of {allowed}, got {given!r}")
        if option.minimum is not None and not given >= option.minimum:
            raise ValueError(f"{option.flag} must be at least {option.minimum:g}, got {given}")
        if option.maximum is not None and not given <= option.maximum:
            raise ValueError(f"{option.flag} must be at most {option.maximum:g}, got {given}")
