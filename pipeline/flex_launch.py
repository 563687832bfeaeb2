"""The Flex Template's main file: template parameters in, ``docbeam run --no-wait`` out.

Dataflow's Python launcher runs this file with each template parameter as ``--name=value`` followed by
the pipeline options of the launch (project, region, staging and temp locations, the job name, the
image, the service account). The parameters (docker/flex-template/metadata.json) map onto ``docbeam run``;
everything else goes to Beam after the profile's own options, so the launch's values win over the
profile's placeholders. The launcher must not wait for the job: the job commits its own output.
"""
from __future__ import annotations

import argparse
import os
import sys

PARAMETERS = ("config", "input", "output", "overrides")
OVERRIDE_SEPARATOR = ";"  # the launch API's parameters are strings: several key=value in one


def to_run_args(argv: list[str]) -> list[str]:
    parser = argparse.ArgumentParser(prog="flex_launch", add_help=False)
    parser.add_argument("--config", required=True)
    parser.add_argument("--input")
    parser.add_argument("--output")
    parser.add_argument("--overrides", default="")
    known, beam_args = parser.parse_known_args(argv)
    args = ["run", "--config", profile_path(known.config), "--no-wait"]
    if known.input:
        args += ["--set", f"input.path={known.input}"]
    if known.output:
        args += ["--set", f"output.path={known.output}"]
    for item in known.overrides.split(OVERRIDE_SEPARATOR):
        if item.strip():
            args += ["--set", item.strip()]
    return args + (["--", *beam_args] if beam_args else [])


def profile_path(config: str) -> str:
    """A relative profile is looked up in the working folder, then beside this package (the image's
    /opt/docbeam/configs), since the launcher's working folder is not ours to choose."""
    if os.path.isabs(config) or os.path.exists(config):
        return config
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), config)


def main(argv: list[str] | None = None) -> int:
    from pipeline import cli

    return cli.main(to_run_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
