"""docs/CONFIG.md is generated from the config structs' docstrings (common/config_doc.py) and
kept in sync: this test fails while the file differs from what the generator writes."""

from __future__ import annotations

from pathlib import Path

import msgspec

from common import config
from common.config_doc import DOC_PATH, UNDOCUMENTED, main, render


def test_the_configuration_reference_is_up_to_date() -> None:
    assert DOC_PATH.is_file(), f"{DOC_PATH} is missing; run: python -m common.config_doc"
    assert DOC_PATH.read_text() == render(), (
        "docs/CONFIG.md is out of date with common/config.py or config.yaml; regenerate it: "
        "python -m common.config_doc"
    )


def test_every_key_is_documented_with_its_type_default_and_variable() -> None:
    text = render()
    for section in msgspec.structs.fields(config.Config):
        assert f"\n## {section.name}\n" in text
        for field in msgspec.structs.fields(section.type):
            heading = f"### `{section.name}.{field.name}`\n"
            assert heading in text, heading
            entry = text.split(heading, 1)[1].split("\n### ", 1)[0]
            assert f"TANDEM_{section.name.upper()}__{field.name.upper()}" in entry
            assert entry.startswith("\nType `") and ", default `" in entry
    assert UNDOCUMENTED not in text, "a config field has no docstring"


def test_check_mode_says_when_the_file_is_stale(tmp_path: Path) -> None:
    stale = tmp_path / "CONFIG.md"
    stale.write_text("# old\n")
    assert main(["--check", "--out", str(stale)]) == 1
    assert main(["--out", str(stale)]) == 0
    assert main(["--check", "--out", str(stale)]) == 0
    assert stale.read_text() == render()
