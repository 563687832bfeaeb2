"""pipeline/compat.py: the Beam workaround says which versions it was checked for, and says so when Beam is
outside them."""

from __future__ import annotations

import logging
import subprocess
import sys

import apache_beam
import pytest
from conftest import REPO, checkout_env

from docbeam.pipeline import compat


def test_the_installed_beam_is_one_the_workaround_was_checked_for():
    assert compat.beam_version_problem(apache_beam.__version__) is None


@pytest.mark.parametrize("version", ["2.76.0", "2.79.0", "3.0.0"])
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


def test_run_inference_comes_from_one_explicit_call_without_its_model_manager():
    """Importing the encode stage applies the patch through compat's one call; in a fresh process the module it
    returns is RunInference's, imported with the ModelManager left out (so torch is not imported) and resource
    given back."""
    code = (
        "import sys; from docbeam.pipeline import compat; base = compat.run_inference_without_model_manager(); "
        "import docbeam.pipeline.stages.encode as encode; "
        "print(base is sys.modules['apache_beam.ml.inference.base'], base is compat.run_inference_without_model_manager(), "
        "encode.RunInference is base.RunInference, sys.modules[compat.MODEL_MANAGER] is None, "
        "base.resource is not None, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=checkout_env(), capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["True", "True", "True", "True", "True", "False"]


@pytest.mark.parametrize(
    "name, direct",
    [
        ("DirectRunner", True),
        ("direct", True),
        ("DIRECTRUNNER", True),
        ("apache_beam.runners.direct.direct_runner.DirectRunner", True),
        ("DataflowRunner", False),
        ("PortableRunner", False),
    ],
)
def test_every_spelling_beam_takes_for_the_direct_runner_gets_it_without_prism(name, direct):
    from apache_beam.runners.direct.direct_runner import DirectRunner

    runner = compat.runner_for(name)
    assert isinstance(runner, DirectRunner) if direct else runner is None


@pytest.mark.slow
def test_a_job_on_the_direct_runner_never_hands_its_pipeline_to_prism(monkeypatch, tmp_path, tiny_checkpoint_dir):
    """Beam's DirectRunner would download Prism and run there; offline it tries, fails and falls back."""
    from apache_beam.runners.portability import prism_runner
    from conftest import job_config

    from docbeam.pipeline.driver.run import run_job

    tried = []

    def refuse(self, pipeline, options):
        tried.append(pipeline)
        raise RuntimeError("no Prism here")

    monkeypatch.setattr(prism_runner.PrismRunner, "run_pipeline", refuse)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "a", "text": "hello world"}\n{"id": "b", "text": "good night"}\n')
    summary = run_job(job_config(str(corpus), str(tmp_path / "out"), tiny_checkpoint_dir, runner={"name": "direct"}))
    assert summary["docs_embedded"] == 2 and tried == []
