"""docs/options.md is Config, written out: the committed page equals the generated one."""

from __future__ import annotations

from pathlib import Path

import pytest

from rannc_fx import Config
from rannc_fx.__main__ import main as cli
from rannc_fx.plan.options_doc import REGENERATE, options_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "options.md"


def test_the_options_page_is_the_generated_one() -> None:
    assert PAGE.is_file(), f"docs/options.md is missing; write it with `{REGENERATE}`"
    assert PAGE.read_text(encoding="utf-8") == options_markdown(), (
        f"docs/options.md differs from Config's fields; write it again with `{REGENERATE}`"
    )


def test_every_field_has_its_row() -> None:
    rows = {line.split("|")[1].strip(): line for line in options_markdown().splitlines()
            if line.startswith("| `")}
    assert set(rows) == {f"`{name}`" for name in Config.model_fields}
    for name, info in Config.model_fields.items():
        row = rows[f"`{name}`"]
        assert f"`RANNC_FX_{name.upper()}`" in row
        assert info.description and " ".join(info.description.split()) in row.replace("\\|", "|")


def test_the_command_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["options"]) == 0
    assert capsys.readouterr().out == options_markdown()
