"""README's "A complete config file" is a config the router accepts, and it shows
every section a config file may hold (the sections documented in a place of
their own are named here), so the README cannot fall behind the code."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec

from router.config import Config, build_config

README = Path(__file__).resolve().parent.parent / "README.md"
# Sections the README documents beside the features they configure.
ELSEWHERE = {"otel", "discover"}


def complete_config() -> str:
    text = README.read_text()
    match = re.search(r"A complete config file.*?```toml\n(.*?)```", text, re.S)
    assert match is not None, "README lost its complete config file"
    return match.group(1)


def test_the_readmes_complete_config_is_valid_and_shows_every_section() -> None:
    document = tomllib.loads(complete_config())
    build_config(document)  # raises, naming the field, if it is not valid
    sections = {
        field.encode_name
        for field in msgspec.structs.fields(Config)
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct)
    }
    missing = sections - ELSEWHERE - set(document)
    assert not missing, f"sections the README's complete config does not show: {missing}"
