"""`run`'s options, built from RunConfig's fields (poolbench.config): each field's Option gives its name, help and
command-line type, its group the help panel, its pydantic field the default and validation; nothing is restated."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import typer

from poolbench.config import Option, RunConfig, field_group, run_options
from poolbench.errors import PoolBenchError


def _cli_type(annotation: Any, option: Option) -> Any:
    """What Typer parses for a field: its Option's type, a list for many-valued ones, str for a Literal."""
    if option.cli_type is not None:
        return option.cli_type
    if option.many:
        return list[str] | None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal or (args and typing.get_origin(args[0]) is typing.Literal):
        return str
    return annotation


def _cli_default(name: str, option: Option) -> Any:
    """The field's default; None for a many-valued or factory-made one (not given: the field's default stands)."""
    info = RunConfig.model_fields[name]
    return None if option.many or info.default_factory is not None else info.default


def run_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per `run` option, as Typer reads a command's signature."""
    params = []
    for name, option in run_options().items():
        name_on = option.option_name(name)
        is_bool = RunConfig.model_fields[name].annotation is bool
        decls = [option.flag or (f"{name_on}/--no-{name_on[2:]}" if is_bool else name_on)]
        params.append(inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, annotation=_cli_type(RunConfig.model_fields[name].annotation, option),
            default=typer.Option(_cli_default(name, option), *decls, help=option.help,
                                 rich_help_panel=field_group(name))))
    return params


def with_run_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command(**values)` with RunConfig's options as its signature, for Typer."""
    command.__signature__ = inspect.Signature(run_parameters())  # type: ignore[attr-defined]
    return command


def config_values(values: dict[str, Any]) -> dict[str, Any]:
    """The command line's values as RunConfig's: parsed where the field says, left out where not given."""
    options = run_options()
    out = {}
    for name, value in values.items():
        option = options[name]
        if option.many and not value:
            continue  # not given (Typer's None, click's empty tuple): the field's default stands
        if value is None and RunConfig.model_fields[name].default_factory is not None:
            continue
        out[name] = option.parse(value) if option.parse is not None and value is not None else value
    return out


def run_config_of(values: dict[str, Any]) -> tuple[RunConfig, tuple[str, ...]]:
    """The RunConfig of `run`'s command line and the models named (one run each, or a cross-model run); a bad value
    stops in one line naming the option the user typed."""
    from pydantic import ValidationError

    fields = config_values(values)
    models = tuple(v.strip() for value in fields.pop("model", ()) for v in value.split(",") if v.strip())
    try:
        cfg = RunConfig(**fields, **({"model": models[0]} if models else {}))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        option = run_options()[field].option_name(field) if field in run_options() else field
        raise PoolBenchError(f"{option}: {first['msg']}") from None
    return cfg, models or (cfg.model,)


def option_names() -> dict[str, str]:
    """Each `run` option's name -> its RunConfig field (the `--x/--no-x` pairs by their first name)."""
    return {(option.flag or option.option_name(name)).split("/")[0]: name for name, option in run_options().items()}

