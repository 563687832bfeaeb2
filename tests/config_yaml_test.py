"""The config's YAML read as a config means it (docbeam/config/files.py ConfigLoader): YAML 1.1's guesses are not
taken (off, on, yes, no stay words; a date is refused, not silently a date), a key given twice is refused, and a
file built to blow up (a recursive anchor, a "billion laughs" of aliases) is refused at once, each naming the
file and the key or line: exit 2, as every config error."""

from __future__ import annotations

import time

import pytest

from docbeam import config

BASE = "input: {path: docs.jsonl}\noutput: {path: out}\n"


def load(tmp_path, text: str, sets: list[str] = ()):
    path = tmp_path / "job.yaml"
    path.write_text(BASE + text)
    return config.load(str(path), list(sets))


def test_off_is_the_word_off_as_the_readme_writes_it(tmp_path):
    assert load(tmp_path, "model: {dtype: bfloat16, precision_gate: off}").model.precision_gate == "off"
    assert load(tmp_path, "", ["model.precision_gate=off"]).model.precision_gate == "off"


def test_yes_is_not_a_boolean_and_is_refused_where_one_is_wanted(tmp_path):
    with pytest.raises(config.ConfigError, match=r"model.normalize.*got 'yes'"):
        load(tmp_path, "model: {normalize: yes}")
    assert load(tmp_path, "model: {normalize: true}").model.normalize is True


@pytest.mark.parametrize(
    "text, refused",
    [
        ("model: {dtype: float32}\nmodel: {dtype: bfloat16}\n", r"key 'model' is given twice .*lines 3 and 4"),
        ("model:\n  dtype: float32\n  dtype: bfloat16\n", r"key 'dtype' is given twice"),
        ("runner: {name: 2026-12-06}\n", r"runner.name: YAML reads 2026-12-06 as a date"),
        ("runner: &r {options: {labels: *r}}\n", r"alias \*r refers to a node that contains it"),
    ],
)
def test_a_file_that_says_two_things_or_a_date_or_refers_to_itself_is_refused_naming_where(tmp_path, text, refused):
    with pytest.raises(config.ConfigError, match=refused):
        load(tmp_path, text)


def test_a_billion_laughs_file_is_refused_at_once(tmp_path):
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    started = time.perf_counter()
    with pytest.raises(config.ConfigError, match=r"more than 64 aliases"):
        load(tmp_path, "\n".join(lines) + "\n")
    assert time.perf_counter() - started < 5


def test_a_merge_key_may_still_be_overridden(tmp_path):
    text = "x-base: &base {dtype: bfloat16, precision_gate: warn}\nmodel:\n  <<: *base\n  precision_gate: off\n"
    path = tmp_path / "job.yaml"
    path.write_text(BASE + text)
    raw = config.files.read_yaml(str(path))
    assert raw["model"] == {"dtype": "bfloat16", "precision_gate": "off"}
