"""Command line: ``python -m rannc_fx plan MODULE:FACTORY --world-size N --device PRESET``
(with a flag for every Config field: ``--max-micro-batches 64``),
``python -m rannc_fx trace summary FILE`` and ``python -m rannc_fx options`` (the options
page, docs/options.md)."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from .partition import partition
from .plan.config_flags import add_config_flags, config_from_flags, explain, name_flags
from .plan.device import DeviceSpec

__all__ = ["main"]

# the plan is made for the device its ranks will run on, so here Config.device is also where
# the costs come from, and it may name a device that is not this machine's
_DEVICE_NOTE = (
    "here also where costs come from: a torch device (cpu, cuda) is measured on, a preset ("
    + ", ".join(DeviceSpec.presets()) + ") is planned for with the analytic cost model "
    "(needed with --meta); by default the costs are measured where the factory's model is"
)


def _factory_kwargs(items: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--arg {item!r}: write it as NAME=VALUE, e.g. --arg layers=24")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def _load_factory(spec: str) -> Any:
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        raise SystemExit(
            f"{spec!r}: name a factory as MODULE:FUNCTION, e.g. examples.models:gpt_example; "
            "it returns (model, args) or (model, args, kwargs)"
        )
    try:
        return getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"cannot load {spec!r}: {e}") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rannc_fx", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="partition a model and print/write its plan")
    plan.add_argument("factory", help="MODULE:FUNCTION returning (model, args[, kwargs])")
    plan.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                      help="keyword argument for the factory (repeatable)")
    plan.add_argument("--world-size", type=int, required=True, help="number of devices")
    plan.add_argument("--meta", action="store_true",
                      help="build the model on the meta device (no weights allocated)")
    plan.add_argument("--global-batch", type=int, default=None,
                      help="samples per step (default: the factory's example batch)")
    plan.add_argument("--out", default="plan.json", help="where to write the plan JSON")
    talk = plan.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true",
                      help="print only the plan and warnings (by default each planning pass "
                           "logs one line to stderr, and progress while it runs long)")
    talk.add_argument("-v", "--verbose", action="store_true",
                      help="also log debug details (DPs run, ops without a backward, what "
                           "torch.export printed)")
    add_config_flags(plan, notes={"device": _DEVICE_NOTE})
    trace = sub.add_parser("trace", help="read a trace written with Config.trace_dir")
    what = trace.add_subparsers(dest="trace_command", required=True)
    summary = what.add_parser("summary", help="busy, bubble and communication per stage, "
                              "measured and predicted")
    summary.add_argument("file", help="the trace.json a traced run wrote")
    sub.add_parser("options", help="print the options page (every Config field) as Markdown: "
                   "python -m rannc_fx options > docs/options.md")
    return p


def _level(args: argparse.Namespace) -> int:
    return logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO


def _trace_summary(path: str) -> int:
    from .runtime.tracefile import format_summary, summarize

    try:
        trace = json.loads(Path(path).read_text())
        summary = summarize(trace)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {path}: not a rannc_fx trace ({type(e).__name__}: {e}); write one with "
              "Config(trace_dir=...) or RANNC_FX_TRACE_DIR", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "trace":
        return _trace_summary(args.file)
    if args.command == "options":
        from .plan.options_doc import options_markdown

        sys.stdout.write(options_markdown())
        return 0
    # rannc_fx's logger alone, so that -v does not turn on torch's own debug logging; the
    # level is put back so that main() called from Python leaves logging as it found it
    logging.basicConfig(format="%(message)s")  # a stderr handler, unless logging has one
    log = logging.getLogger("rannc_fx")
    before = log.level
    log.setLevel(_level(args))
    try:
        return _plan(args)
    finally:
        log.setLevel(before)


def _plan(args: argparse.Namespace) -> int:
    try:  # before the model is built: a bad flag costs nothing
        config = config_from_flags(args)
    except ValidationError as e:
        for line in explain(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    device = config.device
    if device in DeviceSpec.presets():  # a cost model, not a device a rank could run on
        config = config.model_copy(update={"device": None})
    elif device is None and args.meta:
        raise SystemExit("--meta needs --device PRESET (the analytic cost model): "
                         + ", ".join(DeviceSpec.presets()))
    factory = _load_factory(args.factory)
    with torch.device("meta") if args.meta else nullcontext():
        made = factory(**_factory_kwargs(args.arg))
    model, ex_args, ex_kwargs = (*made, {}) if len(made) == 2 else made
    try:
        parted = partition(model, tuple(ex_args), dict(ex_kwargs), world_size=args.world_size,
                           device=device, config=config, global_batch=args.global_batch)
    except ValueError as e:
        print(f"error: {name_flags(str(e))}", file=sys.stderr)
        return 2
    print(parted.plan.summary())
    parted.plan.save(args.out)
    print(f"plan written to {args.out} (search took {parted.plan.search_seconds:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
