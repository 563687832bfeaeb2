"""The README's config table holds every key of the typed config, no other, each with its default."""

from __future__ import annotations

import os

import pydantic
import yaml
from conftest import REPO

from docbeam import config

README = os.path.join(REPO, "README.md")
README_PATTERNS = {"attention.backend_options": "attention.<backend>"}
REQUIRED = "—"


def readme_config_table() -> dict[str, str]:
    """Documented key → its default cell, from the `| key | default | meaning |` table under ## Configuration."""
    with open(README) as f:
        section = f.read().split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = {}
    for row in rows:
        keys_cell, default_cell = [cell.strip() for cell in row.strip("|").split(" | ")[:2]]
        keys = [k.strip().strip("`") for k in keys_cell.split(",")]
        defaults = [d.strip() for d in default_cell.split(",")] if len(keys) > 1 else [default_cell]
        assert len(defaults) == len(keys), f"README row {keys_cell}: one default per key, got {default_cell!r}"
        table.update(zip(keys, defaults))
    return table


def model_keys(model=config.JobConfig, prefix="") -> dict[str, object]:
    """Dotted key → the field's default (REQUIRED when it has none), sections flattened."""
    out = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if isinstance(field.annotation, type) and issubclass(field.annotation, pydantic.BaseModel):
            out.update(model_keys(field.annotation, f"{key}."))
        else:
            out[README_PATTERNS.get(key, key)] = REQUIRED if field.is_required() else field.default
    return out


def documented_default(cell: str):
    if cell == REQUIRED:
        return REQUIRED
    return yaml.safe_load(cell.strip("`")) if cell.count("`") in (0, 2) else cell


FILE_KEYS = {"extends": REQUIRED}  # read by docbeam/config/files.py before the sections are validated


def test_the_readme_config_table_has_every_key_and_no_other():
    documented, actual = set(readme_config_table()), set(model_keys()) | set(FILE_KEYS)
    assert actual - documented == set(), "keys missing from the README's configuration table"
    assert documented - actual == set(), "keys the README documents but the config does not have"


def test_the_readme_config_table_gives_each_default():
    table, actual = readme_config_table(), {**model_keys(), **FILE_KEYS}
    for key, cell in table.items():
        default, written = actual[key], documented_default(cell)
        if key in README_PATTERNS.values():
            assert written == REQUIRED, key
        elif default is None:  # `null`, or what null means in words ("checkpoint's")
            assert written is None or (isinstance(written, str) and written != REQUIRED), f"{key}: {cell}"
        else:
            expected = list(default) if isinstance(default, tuple) else default
            expected = expected.model_dump() if hasattr(expected, "model_dump") else expected
            assert written == expected, f"{key}: README says {cell}, the code's default is {default!r}"
