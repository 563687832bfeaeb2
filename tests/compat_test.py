"""pipeline/compat.py: the Beam workaround says which versions it was checked for, and says so when Beam is
outside them."""
from __future__ import annotations

import logging

import apache_beam
import pytest

from docbeam.pipeline import compat


def test_the_installed_beam_is_one_the_workaround_was_checked_for():
    assert compat.beam_version_problem(apache_beam.__version__) is None


@pytest.mark.parametrize("version", ["2.76.0", "2.78.0", "3.0.0"])
def test_a_beam_outside_the_checked_versions_is_named_with_the_fix(version):
    problem = compat.beam_version_problem(version)
    assert problem is not None and version in problem and "CHECKED_BEAM" in problem


def test_a_version_that_is_not_a_version_raises_naming_it():
    with pytest.raises(ValueError, match="'nightly'"):
        compat.beam_minor("nightly")


def test_an_unchecked_beam_is_logged(monkeypatch, caplog):
    monkeypatch.setattr(apache_beam, "__version__", "2.99.1")
    with caplog.at_level(logging.WARNING, logger="docbeam.pipeline.compat"):
        compat.check_beam_version()
    assert "apache-beam 2.99.1 is outside" in caplog.text
