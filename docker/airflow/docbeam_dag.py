"""Cloud Composer / Airflow: the daily docbeam TPU job, launched from the Flex Template.

Copy this file into the environment's dags/ folder after replacing the placeholders (project, region,
bucket, image); docs/runbook.md builds the template and the image it launches.
Every value the profile holds as a placeholder is passed here explicitly (project, temp and staging
locations, worker image, input, output, compilation cache): the launcher refuses a launch that leaves one.
Each run embeds the day's corpus into its own folder, so a rerun of one day replaces only that day.
"""

from __future__ import annotations

import pendulum
from airflow import DAG
from airflow.providers.google.cloud.operators.dataflow import DataflowStartFlexTemplateOperator

PROJECT = "my-docbeam-project"
REGION = "us-central1"
BUCKET = "gs://my-docbeam-bucket"
# The image built from docker/Dockerfile (FLAVOUR=tpu): it launches the template and runs the workers.
IMAGE = f"{REGION}-docker.pkg.dev/{PROJECT}/docbeam/worker-tpu:0.1.0"
WORKER_SERVICE_ACCOUNT = f"docbeam-worker@{PROJECT}.iam.gserviceaccount.com"

with DAG(
    dag_id="docbeam_daily_tpu",
    schedule="0 3 * * *",  # 03:00 UTC, after the day's corpus has landed
    start_date=pendulum.datetime(2026, 12, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,  # one writer per output; docbeam's output lock refuses a second anyway
    tags=["docbeam"],
) as dag:
    DataflowStartFlexTemplateOperator(
        task_id="embed_documents",
        project_id=PROJECT,
        location=REGION,
        body={
            "launchParameter": {
                "jobName": "docbeam-tpu-{{ ds_nodash }}",
                "containerSpecGcsPath": f"{BUCKET}/templates/docbeam-tpu.json",
                # The template's parameters (docker/flex-template/metadata.json); {{ ds }} is Airflow's
                # logical date, so a backfill writes the day it stands for.
                "parameters": {
                    "config": "configs/dataflow_tpu.yaml",
                    "input": f"{BUCKET}/corpus/{{{{ ds }}}}/*.jsonl.gz",
                    "output": f"{BUCKET}/runs/{{{{ ds }}}}",
                    # One cache per accelerator type: tomorrow's job reuses today's compilations.
                    "compilation_cache": f"{BUCKET}/jax-cache/tpu-v5e",
                },
                "environment": {
                    "sdkContainerImage": IMAGE,
                    "serviceAccountEmail": WORKER_SERVICE_ACCOUNT,
                    "tempLocation": f"{BUCKET}/dataflow/temp",
                    "stagingLocation": f"{BUCKET}/dataflow/staging",
                },
            }
        },
        wait_until_finished=True,  # the task fails when the job fails (nothing was committed then)
    )
