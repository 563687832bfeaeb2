"""The Flex Template (metadata.json), its launcher (pipeline/driver/flex_launch.py) and the Airflow DAG that starts it.

Airflow is not installed here (it is heavy): the DAG file is read with ``ast`` and its operator's arguments
checked against the template's parameters.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex

import pytest
from conftest import SAMPLE, job_config

from docbeam.config import ConfigError
from docbeam.pipeline.driver import flex_launch
from docbeam.pipeline.driver.run import run_job
from docbeam.pipeline.store import output

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METADATA = os.path.join(REPO, "docker", "flex-template", "metadata.json")
DAG = os.path.join(REPO, "docker", "airflow", "docbeam_dag.py")
SCHEDULER_BODY = os.path.join(REPO, "docker", "flex-template", "scheduler_body.json")
RUNBOOK = os.path.join(REPO, "docs", "runbook.md")  # step 5 holds the flex-template run users copy
PARAM_TYPES = {"TEXT", "GCS_READ_FILE", "GCS_WRITE_FOLDER"}
# The launch request's environment, as Dataflow's launcher hands it to the main file (Beam's option names).
ENVIRONMENT_OPTIONS = {
    "tempLocation": "temp_location",
    "stagingLocation": "staging_location",
    "sdkContainerImage": "sdk_container_image",
    "serviceAccountEmail": "service_account_email",
}
# What a user puts where the shipped files say my-docbeam-*: every other value is the files' own.
USERS_OWN = {"my-docbeam-project": "acme-prod", "my-docbeam-bucket": "acme-embeddings"}


def metadata() -> dict:
    with open(METADATA) as f:
        return json.load(f)


def test_the_template_declares_typed_parameters_that_the_launcher_reads():
    params = {p["name"]: p for p in metadata()["parameters"]}
    assert tuple(params) == flex_launch.PARAMETERS
    assert [n for n, p in params.items() if not p["isOptional"]] == ["config"]
    assert all(p["paramType"] in PARAM_TYPES and p["label"] and p["helpText"] for p in params.values())


@pytest.mark.parametrize(
    "name, good, bad",
    [
        ("config", "configs/dataflow_tpu.yaml", "configs/dataflow_tpu.json"),
        ("output", "gs://b/runs/{run_date}", "gs://b/runs/*"),
        ("compilation_cache", "gs://b/jax-cache/tpu-v5e", "/local/jax-cache"),
        ("overrides", "batching.shards=32;attention.verify=false", "batching.shards"),
    ],
)
def test_parameter_regexes_accept_good_values_and_refuse_bad_ones(name, good, bad):
    (regex,) = next(p for p in metadata()["parameters"] if p["name"] == name)["regexes"]
    assert re.fullmatch(regex, good) and not re.fullmatch(regex, bad)


def test_parameters_map_to_docbeam_run_and_launch_options_go_to_beam_after_the_profiles(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the launcher's working folder is not the image's /opt/docbeam
    args = flex_launch.to_run_args(
        [
            "--config=configs/dataflow_tpu.yaml",
            "--input=gs://b/corpus/x.jsonl",
            "--output=gs://b/runs/{run_date}",
            "--compilation_cache=gs://b/jax-cache/tpu-v5e",
            "--overrides=batching.shards=32; attention.verify=false",
            "--project=real-project",
            "--region=us-east5",
            "--temp_location=gs://b/tmp",
            "--job_name=docbeam-20261130",
        ]
    )
    assert args == [
        "run",
        "--config",
        os.path.join(REPO, "configs", "dataflow_tpu.yaml"),
        "--no-wait",
        "--set",
        "input.path=gs://b/corpus/x.jsonl",
        "--set",
        "output.path=gs://b/runs/{run_date}",
        "--set",
        "runner.compilation_cache=gs://b/jax-cache/tpu-v5e",
        "--set",
        "batching.shards=32",
        "--set",
        "attention.verify=false",
        "--",
        "--project=real-project",
        "--region=us-east5",
        "--temp_location=gs://b/tmp",
        "--job_name=docbeam-20261130",
    ]


def test_only_the_config_is_required():
    assert flex_launch.to_run_args(["--config=/abs/p.yaml"]) == ["run", "--config", "/abs/p.yaml", "--no-wait"]
    with pytest.raises(SystemExit):
        flex_launch.to_run_args(["--input=gs://b/x"])


@pytest.mark.slow
def test_a_driver_that_does_not_wait_still_gets_a_committed_output_and_a_released_lock(tiny_checkpoint_dir, tmp_path):
    cfg = job_config(SAMPLE, str(tmp_path / "runs" / "{run_date}"), tiny_checkpoint_dir)
    dates = {output.run_date()}  # the date the run is planned on, or the next one if midnight UTC passed
    submitted = run_job(cfg, wait=False)
    out = submitted["output"]
    dates.add(output.run_date())
    assert submitted["submitted"] and out in {str(tmp_path / "runs" / d) for d in dates}
    manifest = output.read_manifest(out)
    assert manifest["run_id"] == submitted["run_id"]
    assert os.path.exists(os.path.join(out, "_SUCCESS")) and not os.path.exists(os.path.join(out, "_lock.json"))


def dag_operator_call() -> ast.Call:
    tree = ast.parse(open(DAG).read())
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("airflow.providers.google.cloud.operators.dataflow", "DataflowStartFlexTemplateOperator") in imports
    (call,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DataflowStartFlexTemplateOperator"
    ]
    return call


def literal(node: ast.AST, names: dict):
    """A literal, resolving module-level names and f-strings whose parts are literals or those names."""
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.JoinedStr):
        return "".join(
            str(literal(v.value, names)) if isinstance(v, ast.FormattedValue) else v.value for v in node.values
        )
    if isinstance(node, ast.Dict):
        return {literal(k, names): literal(v, names) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def module_constants() -> dict:
    names = {}
    for node in ast.parse(open(DAG).read()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = literal(node.value, names)
    return names


def test_the_airflow_dag_launches_the_template_with_its_parameters_and_waits_for_the_job():
    call = dag_operator_call()
    kwargs = {k.arg: literal(k.value, module_constants()) for k in call.keywords}
    assert set(kwargs) == {"task_id", "project_id", "location", "body", "wait_until_finished"}
    launch = kwargs["body"]["launchParameter"]
    assert launch["containerSpecGcsPath"].startswith("gs://") and launch["containerSpecGcsPath"].endswith(".json")
    assert set(launch["parameters"]) <= set(flex_launch.PARAMETERS) and "config" in launch["parameters"]
    assert os.path.exists(os.path.join(REPO, launch["parameters"]["config"]))
    assert "{{ ds }}" in launch["parameters"]["output"], "each day's run needs its own output folder"
    assert set(launch["environment"]) <= set(ENVIRONMENT_OPTIONS)
    assert kwargs["wait_until_finished"] is True


def test_the_dag_schedules_one_run_a_day_without_overlap():
    tree = ast.parse(open(DAG).read())
    (dag,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DAG"]
    kwargs = {k.arg: k.value for k in dag.keywords}
    assert len(ast.literal_eval(kwargs["schedule"]).split()) == 5
    assert ast.literal_eval(kwargs["max_active_runs"]) == 1 and ast.literal_eval(kwargs["catchup"]) is False


def test_the_cloud_scheduler_body_launches_the_template_into_a_folder_per_day():
    with open(os.path.join(REPO, "docker", "flex-template", "scheduler_body.json")) as f:
        launch = json.load(f)["launchParameter"]
    assert set(launch["parameters"]) <= set(flex_launch.PARAMETERS) and "config" in launch["parameters"]
    # Cloud Scheduler sends the same body every day: the date comes from docbeam's own placeholder.
    assert "{run_date}" in launch["parameters"]["output"]
    assert os.path.exists(os.path.join(REPO, launch["parameters"]["config"]))


def launcher_argv(launch: dict, project: str, region: str) -> list[str]:
    """What Dataflow's Python launcher runs the main file with, for this launch request: each template
    parameter as --name=value, then the launch's pipeline options."""
    return (
        [f"--{name}={value}" for name, value in launch["parameters"].items()]
        + [f"--{ENVIRONMENT_OPTIONS[key]}={value}" for key, value in launch.get("environment", {}).items()]
        + [f"--project={project}", f"--region={region}"]
    )


def filled_in(text: str) -> str:
    """A shipped launch file after its user replaced the placeholders it shows, and nothing else."""
    for placeholder, own in USERS_OWN.items():
        text = text.replace(placeholder, own)
    return text


def test_the_cloud_scheduler_body_filled_in_replaces_every_placeholder_of_its_profile():
    launch = json.loads(filled_in(open(SCHEDULER_BODY).read()))["launchParameter"]
    flex_launch.refuse_placeholders(flex_launch.parse(launcher_argv(launch, "acme-prod", "us-central1")))


def test_the_airflow_dag_filled_in_replaces_every_placeholder_of_its_profile():
    tree = ast.parse(filled_in(open(DAG).read()))
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = literal(node.value, names)
    (call,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "DataflowStartFlexTemplateOperator"
    ]
    kwargs = {k.arg: literal(k.value, names) for k in call.keywords}
    # Airflow renders its templates ({{ ds }}: the logical date) before the operator sends the body.
    launch = json.loads(json.dumps(kwargs["body"]["launchParameter"]).replace("{{ ds }}", "2026-11-30"))
    flex_launch.refuse_placeholders(flex_launch.parse(launcher_argv(launch, kwargs["project_id"], kwargs["location"])))


def runbook_flex_template_run() -> dict:
    """The runbook's `gcloud dataflow flex-template run` command as a launch request, its shell variables set
    as the runbook's step list defines them."""
    text = open(RUNBOOK).read()
    (command,) = re.findall(r"^ *gcloud dataflow flex-template run (?:.*\\\n)*.*$", text, re.M)
    shell = {
        "$PROJECT": "acme-prod",
        "$REGION": "us-central1",
        "$BUCKET": "gs://acme-embeddings",
        "$SA": "docbeam-worker@acme-prod.iam.gserviceaccount.com",
        "$IMAGE": "us-central1-docker.pkg.dev/acme-prod/docbeam/worker-tpu:0.1.0",
    }
    command = command.replace("\\\n", " ")
    for name, value in shell.items():
        command = command.replace(name, value)
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in shlex.split(command) if arg.startswith("--"))
    environment = {
        "tempLocation": flags.pop("temp-location"),
        "stagingLocation": flags.pop("staging-location"),
        "serviceAccountEmail": flags.pop("service-account-email"),
    }
    parameters = dict(item.split("=", 1) for item in flags.pop("parameters").split(","))
    return {
        "project": flags["project"],
        "region": flags["region"],
        "parameters": parameters,
        "environment": environment,
    }


def test_the_runbooks_flex_template_run_replaces_every_placeholder_of_its_profile():
    launch = runbook_flex_template_run()
    assert "sdk_container_image" in launch["parameters"] and "compilation_cache" in launch["parameters"]
    flex_launch.refuse_placeholders(flex_launch.parse(launcher_argv(launch, launch["project"], launch["region"])))


def test_a_launch_that_leaves_placeholders_is_refused_with_exit_2_before_anything_is_submitted(capsys):
    code = flex_launch.main(
        [
            "--config=configs/dataflow_tpu.yaml",
            "--output=gs://acme-embeddings/runs/x",
            "--project=acme-prod",
            "--temp_location=gs://acme-embeddings/tmp",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    refused = {line.split(" is ")[0].strip() for line in err.splitlines() if line.startswith("  ")}
    assert refused == {
        "input.path",
        "runner.compilation_cache",
        "runner.options.staging_location",
        "runner.options.sdk_container_image",
    }, err


def test_template_parameters_and_launch_options_replace_the_profiles_placeholders():
    argv = [
        "--config=configs/dataflow_cpu.yaml",
        "--input=gs://a/in/*.jsonl",
        "--output=gs://a/runs/{run_date}",
        "--compilation_cache=gs://a/jax-cache/cpu",
        "--project=p-1",
        "--temp_location=gs://a/t",
        "--staging_location=gs://a/s",
        "--sdk_container_image=r-docker.pkg.dev/p-1/docbeam/worker-cpu:0.1.0",
    ]
    flex_launch.refuse_placeholders(flex_launch.parse(argv))
    with pytest.raises(ConfigError, match=r"\n  runner.options.project is 'my-docbeam-project'[^\n]*$"):
        flex_launch.refuse_placeholders(flex_launch.parse([a for a in argv if not a.startswith("--project=")]))
