"""Command-line flags made from ``Config``'s fields: one flag a field (``max_micro_batches`` is
``--max-micro-batches``), its value's syntax read from the field's annotation and its help from
the field's description, so that the command line and ``Config`` cannot drift apart.

A flag only splits its text (``--replicas 2,1``, ``none``); ``Config`` converts and validates
the values, so a bad value gets ``Config``'s own message, and ``explain`` names the flags in it.
"""

from __future__ import annotations

import argparse
import re
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from .config import ENV_PREFIX, Config

__all__ = ["add_config_flags", "config_from_flags", "explain", "flag_of", "name_flags"]

_NONE = "none"  # how a field that may be None is set to None: --profile-cache-dir none
_SCALARS: dict[Any, str] = {int: "INT", float: "FLOAT", str: "TEXT", Path: "PATH"}

# short spellings some flags also take: what the issue tracker and users write
ALIASES: dict[str, tuple[str, ...]] = {"autocast_dtype": ("--autocast",)}

GROUP_HELP = (
    "each flag sets the rannc_fx.Config field of its name (--max-micro-batches sets "
    "max_micro_batches); a flag not given leaves Config's default. A field that may be None "
    f"takes '{_NONE}', a tuple is written with commas (--replicas 2,1). {ENV_PREFIX}<NAME> "
    "environment variables override these flags too."
)


def flag_of(name: str) -> str:
    """The flag of the Config field ``name``: ``max_micro_batches`` -> ``--max-micro-batches``."""
    return "--" + name.replace("_", "-")


def add_config_flags(
    parser: argparse.ArgumentParser, *, notes: Mapping[str, str] | None = None
) -> dict[str, str]:
    """One flag per ``Config`` field on ``parser`` (in a group of their own); ``notes`` adds a
    sentence to a field's help where the command reads it its own way. Returns field -> flag."""
    group = parser.add_argument_group("Config options", GROUP_HELP)
    flags: dict[str, str] = {}
    for name, info in Config.model_fields.items():
        parse, metavar = _syntax(name, info)
        default = info.get_default(call_default_factory=True)
        shown = "" if default in (None, ()) else f" (default: {_text(default)})"
        note = f"; {notes[name]}" if notes and name in notes else ""
        help_ = f"{info.description or ''}{note}{shown}".replace("%", "%%")
        # SUPPRESS, not None: a flag not given is absent, so '--trace-dir none' can still
        # mean None where Config's default is something else
        names = (flag_of(name), *ALIASES.get(name, ()))
        if parse is None:
            group.add_argument(*names, dest=name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_)
        else:
            group.add_argument(*names, dest=name, type=parse, metavar=metavar,
                               default=argparse.SUPPRESS, help=help_)
        flags[name] = flag_of(name)
    return flags


def config_from_flags(args: argparse.Namespace) -> Config:
    """The Config the flags given in ``args`` describe (the others at Config's defaults);
    raises pydantic's ValidationError for a bad value (``explain`` words it for a shell)."""
    return Config(**{name: getattr(args, name) for name in Config.model_fields
                     if hasattr(args, name)})


def explain(error: ValidationError) -> str:
    """Config's own messages for ``error``, each under the flag (and field) it concerns."""
    lines = []
    for e in error.errors():
        if e["loc"]:
            name = str(e["loc"][0])
            lines.append(f"{flag_of(name)} {_text(e['input'])} (Config.{name}): {e['msg']}")
        else:  # a check across fields (a model validator) names its fields in its message
            lines.append(name_flags(str(e["msg"]).removeprefix("Value error, ")))
    return "\n".join(lines)


def name_flags(message: str) -> str:
    """``message`` with the flags of the Config fields it names (``max_micro_batches``,
    ``stages=...``) added, for an error seen from the command line."""
    found = {n: m.start() for n in Config.model_fields if (m := _mentions(message, n))}
    named = sorted(found, key=found.__getitem__)  # in the message's order
    if not named:
        return message
    return f"{message} (as flags: " + ", ".join(f"{n} is {flag_of(n)}" for n in named) + ")"


def _mentions(message: str, name: str) -> re.Match[str] | None:
    # a one-word field ('stages', 'device', 'zero') is also an English word: only 'name='
    # (Config(stages=None), zero=1) is taken as the field
    tail = "" if "_" in name else r"(?=\s*=)"
    return re.search(rf"(?<![\w.-]){name}(?![\w-]){tail}", message)


def _syntax(name: str, info: FieldInfo) -> tuple[Callable[[str], Any] | None, str]:
    """(the parser of a flag's text, its metavar) for the field's annotation; no parser means
    a boolean flag (--debug / --no-debug)."""
    members, optional = _members(info.annotation)
    literals = [v for m in members if get_origin(m) is Literal for v in get_args(m)]
    others = [m for m in members if get_origin(m) is not Literal]
    if others == [bool]:
        if optional and info.get_default(call_default_factory=True) is not None:
            raise TypeError(f"Config.{name}: a bool that may be None but defaults to something "
                            "else cannot be written as --flag / --no-flag; give it a value syntax")
        return None, ""
    if len(others) > 1 or (others and not _is_tuple(others[0]) and others[0] not in _SCALARS):
        raise TypeError(f"Config.{name}: no command-line syntax for {info.annotation}; "
                        "teach rannc_fx/plan/config_flags.py one")
    rest = others[0] if others else None
    by_text = {str(v): v for v in literals}

    def parse(text: str) -> Any:
        if optional and text.lower() == _NONE:
            return None
        if text in by_text or rest is None:
            return by_text.get(text, text)  # an unknown choice goes on to Config's message
        if _is_tuple(rest):
            return tuple(t.strip() for t in text.split(",") if t.strip())
        return text  # Config converts it to the field's type and checks it

    shapes = ["{" + ",".join(by_text) + "}"] if by_text else []
    if rest is not None:
        shapes.append(_SCALARS.get(get_args(rest)[0], "TEXT") + ",..." if _is_tuple(rest)
                      else _SCALARS[rest])
    return parse, "|".join(shapes)


def _members(annotation: Any) -> tuple[list[Any], bool]:
    """The annotation's union members other than None, and whether None is one."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = get_args(annotation)
        return [a for a in args if a is not type(None)], type(None) in args
    return [annotation], False


def _is_tuple(tp: Any) -> bool:
    args = get_args(tp)
    return get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _text(value: Any) -> str:
    """A value as it is written on the command line."""
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return _NONE if value is None else str(value).lower() if isinstance(value, bool) else str(value)
