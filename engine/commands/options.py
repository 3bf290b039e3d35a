"""Command-line flags from the option declarations (engine/contracts/options.py): the engine's
``EngineConfig`` for every command that starts an engine, and ``ServeOptions`` for ``serve``.
Type, choices, default and help come from the declaration; nothing here restates them."""

from __future__ import annotations

import argparse
import os
from typing import TypeVar

import msgspec

from engine.contracts.engine_config import EngineConfig
from engine.contracts.options import declared_options

S = TypeVar("S", bound=msgspec.Struct)


def add_declared_arguments(parser: argparse.ArgumentParser, title: str,
                           struct: type[msgspec.Struct], *, skip: tuple[str, ...] = ()) -> None:
    """One flag per declared option of ``struct``, in a group named ``title``."""
    group = parser.add_argument_group(title)
    for option in declared_options(struct):
        if option.name in skip:
            continue
        default = option.default
        shown = "off" if option.kind is bool else default
        if option.env is not None:
            default = os.environ.get(option.env, default)
            shown = f"${option.env}, else {option.default}"
        help_text = f"{option.help} (default: {shown})" if "default:" not in option.help \
            else option.help
        flags = (option.flag, *option.aliases)
        if option.kind is bool:
            group.add_argument(*flags, action="store_true", default=default, help=help_text)
        elif option.kind is list:
            group.add_argument(*flags, nargs="+", default=default, help=help_text,
                               metavar=option.name.upper().removesuffix("S"))
        else:
            group.add_argument(*flags, type=option.kind, default=default,
                               choices=option.choices, help=help_text,
                               metavar=None if option.choices else option.name.upper())


def declared_from_args(args: argparse.Namespace, struct: type[S], **values: object) -> S:
    """``struct`` from parsed flags (``values`` override); checked as declared (ValueError)."""
    fields = {f.name: getattr(args, f.name) for f in msgspec.structs.fields(struct)}
    made = struct(**{**fields, **values})
    made.validate()
    return made


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_declared_arguments(parser, "engine", EngineConfig)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags, with --model resolved to a checkpoint directory
    (engine.checkpoints.model_source: the default model, the demo model, a converted GGUF)."""
    from engine.checkpoints.model_source import resolve_model

    source = resolve_model(args.model)
    config = declared_from_args(args, EngineConfig, model=source.path,
                                served_model_name=args.served_model_name or source.name)
    if config.tp_size > 1:  # a model that does not split that many ways: refused before starting
        from engine.worker.model.config import ModelConfig
        from engine.worker.model.parallel import ShardPlan

        ShardPlan.for_rank(ModelConfig.from_dir(config.model), 0, config.tp_size)
    return config
