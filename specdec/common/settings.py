"""Typed settings objects read from flags and environment variables (flag > env > default).

A field `max_sessions` becomes the flag `--max-sessions` and the variable `SPECDEC_MAX_SESSIONS`, so the
same settings work from a shell, a test and a Kubernetes manifest.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "SPECDEC_"


def setting(default: Any, help: str) -> Any:
    """A settings field with its help text."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple for list defaults")
    return dataclasses.field(default=default, metadata={"help": help})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _parse_value(kind: Any, raw: str) -> Any:
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    if typing.get_origin(kind) is tuple:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"must be one of {[member.value for member in kind]}, got {raw!r}") from None
    return kind(raw)


def settings_parser(cls: type, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of the settings dataclass `cls`."""
    parser = argparse.ArgumentParser(description=description)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        default = field.default.value if isinstance(field.default, enum.Enum) else field.default
        help_text = f"{field.metadata.get('help', '')} [env {env_name(field.name)}; default {default!r}]"
        if kind is bool:
            parser.add_argument(
                flag_name(field.name), action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                flag_name(field.name),
                type=str,
                default=None,
                help=help_text,
                metavar="A,B" if typing.get_origin(kind) is tuple else None,
            )
    return parser


def parse_settings(
    cls: type[T], argv: Sequence[str] | None = None, description: str = "", environ: Mapping[str, str] | None = None
) -> T:
    """Builds `cls` from flags, then `SPECDEC_*` variables, then the field defaults."""
    environ = os.environ if environ is None else environ
    args = vars(settings_parser(cls, description).parse_args(argv))
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        raw = args[field.name]
        if raw is None and env_name(field.name) in environ:
            raw = environ[env_name(field.name)]
        if raw is None:
            continue
        try:
            values[field.name] = raw if isinstance(raw, bool) else _parse_value(hints[field.name], raw)
        except ValueError as error:
            raise ValueError(f"{field.name} {error}") from None
    return cls(**values)
