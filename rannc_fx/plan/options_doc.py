"""Write the options page (``docs/options.md``) from ``Config``'s fields.

Each row is one field: its name, its type and bounds read from the annotation, its default, its
``RANNC_FX_<NAME>`` environment variable and its ``Field(description=...)``. The page is never
edited by hand: ``python -m rannc_fx options > docs/options.md`` writes it again, and
``tests/unit/test_options_doc.py`` fails when the committed page and ``Config`` differ.
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from .config import ENV_PREFIX, Config
from .config_flags import flag_of
from .device import DeviceSpec

__all__ = ["REGENERATE", "options_markdown"]

REGENERATE = "python -m rannc_fx options > docs/options.md"

# A default made by a factory depends on the machine it runs on (a home directory), so the page
# says where it comes from instead of one machine's value.
_FACTORY_DEFAULTS = {
    "profile_cache_dir": "`$XDG_CACHE_HOME/rannc_fx`, else `~/.cache/rannc_fx`",
}

_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def options_markdown() -> str:
    """The whole options page, Markdown, one table row per ``Config`` field in their order."""
    source = Config.__module__.replace(".", "/") + ".py"
    lines = [
        "# Options",
        "",
        f"<!-- Generated from rannc_fx.Config ({source}) by `{REGENERATE}`;",
        "     edit the fields' descriptions there, not this file. -->",
        "",
        "`rannc_fx.Config` holds every option of the compiler and the runtime:",
        "`rannc_fx.compile(model, optimizer, rannc_fx.Config(micro_batches=8))`, or",
        "`rannc_fx.partition(..., config=...)`. Each field can also be set",
        "",
        f"- by an environment variable `{ENV_PREFIX}<NAME>`, its value read as JSON where it",
        f"  parses (`{ENV_PREFIX}REPLICAS=[2,1]`, `{ENV_PREFIX}PROFILE_CACHE_DIR=null`), else as",
        "  text; it overrides the value given in code or on the command line;",
        "- on the command line of `python -m rannc_fx plan`, by the flag made from its name",
        f"  (`max_micro_batches` is `{flag_of('max_micro_batches')}`; a tuple is written with",
        "  commas, `--replicas 2,1`; `none` sets None; a boolean is `--check-batches` /",
        "  `--no-check-batches`). `python -m rannc_fx plan --help` lists them.",
        "",
        "`Config` checks every value, and the fields against each other, however it is given.",
        "`None` for a field the search chooses (`stages`, `replicas`, `micro_batches`,",
        "`schedule`, `recompute*`, `zero`, `offload`, `host_params`) means \"searched\"; a value",
        "forces it, and the forced plan is still checked against the memory budget.",
        "",
        "| option | type | default | environment variable | description |",
        "|---|---|---|---|---|",
    ]
    for name, info in Config.model_fields.items():
        cells = [
            f"`{name}`",
            _code(_type_text(info.annotation) + _bounds(info)),
            _default(name, info),
            f"`{ENV_PREFIX}{name.upper()}`",
            _cell(info.description or ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Device presets for the analytic cost model (`--device` of `python -m rannc_fx plan`,",
        "`DeviceSpec.preset(name)`): "
        + ", ".join(f"`{p}`" for p in DeviceSpec.presets()) + ".",
    ]
    return "\n".join(lines) + "\n"


def _type_text(tp: Any) -> str:
    """An annotation as it reads in Python: ``int | None``, ``'gpipe' | '1f1b' | None``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_text(a) for a in get_args(tp))
    if origin is Literal:
        return " | ".join(repr(v) for v in get_args(tp))
    if origin is tuple:
        args = get_args(tp)
        inner = (f"{_type_text(args[0])}, ..." if len(args) == 2 and args[1] is Ellipsis
                 else ", ".join(_type_text(a) for a in args))
        return f"tuple[{inner}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _bounds(info: FieldInfo) -> str:
    """The field's numeric bounds (``ge=1``, ``lt=1``) as `` (>= 1)``; empty without any."""
    found = [f"{sign} {value}" for m in info.metadata for attr, sign in _BOUNDS
             if (value := getattr(m, attr, None)) is not None]
    return f" ({', '.join(found)})" if found else ""


def _default(name: str, info: FieldInfo) -> str:
    if info.default_factory is not None:
        if name not in _FACTORY_DEFAULTS:
            raise TypeError(f"Config.{name}'s default comes from a factory: say in "
                            f"rannc_fx/plan/options_doc.py's _FACTORY_DEFAULTS what it is")
        return _FACTORY_DEFAULTS[name]
    return _code(repr(info.default))


def _code(text: str) -> str:
    return _cell(f"`{text}`")


def _cell(text: str) -> str:
    """``text`` fit for one table cell: on one line, its pipes escaped (also inside code)."""
    return " ".join(text.split()).replace("|", "\\|")
