"""The Flex Template's main file: template parameters in, ``docbeam run --no-wait`` out.

Dataflow's Python launcher runs this file with each template parameter as ``--name=value`` followed by
the pipeline options of the launch (project, region, staging and temp locations, the job name, the
image, the service account). The parameters (docker/flex-template/metadata.json) map onto ``docbeam run``;
everything else goes to Beam after the profile's own options, so the launch's values win over the
profile's placeholders. A launch that leaves any placeholder in place (project, buckets, image, input,
output, compilation cache) is refused before anything is submitted: its workers would pull an image nobody
built and write to a bucket nobody owns. The launcher must not wait for the job: the job commits its own
output.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

PARAMETERS = ("config", "input", "output", "compilation_cache", "overrides")
OVERRIDE_SEPARATOR = ";"  # the launch API's parameters are strings: several key=value in one
# Parameter -> the docbeam key it sets; `overrides` carries any other key.
PARAMETER_KEYS = {"input": "input.path", "output": "output.path", "compilation_cache": "runner.compilation_cache"}


@dataclasses.dataclass(frozen=True)
class Launch:
    config: str  # the profile's path, resolved against the image's /opt/docbeam
    sets: tuple[str, ...]  # key=value, applied like --set, in order
    beam_args: tuple[str, ...]  # the launch's pipeline options, after the profile's

    def run_args(self) -> list[str]:
        args = ["run", "--config", self.config, "--no-wait"]
        for item in self.sets:
            args += ["--set", item]
        return args + (["--", *self.beam_args] if self.beam_args else [])


def parse(argv: list[str]) -> Launch:
    parser = argparse.ArgumentParser(prog="flex_launch", add_help=False)
    parser.add_argument("--config", required=True)
    for name in PARAMETER_KEYS:
        parser.add_argument(f"--{name}")
    parser.add_argument("--overrides", default="")
    known, beam_args = parser.parse_known_args(argv)
    sets = [f"{key}={getattr(known, name)}" for name, key in PARAMETER_KEYS.items() if getattr(known, name)]
    sets += [item.strip() for item in known.overrides.split(OVERRIDE_SEPARATOR) if item.strip()]
    return Launch(profile_path(known.config), tuple(sets), tuple(beam_args))


def to_run_args(argv: list[str]) -> list[str]:
    return parse(argv).run_args()


def refuse_placeholders(launch: Launch) -> None:
    """Raises ConfigError naming each profile placeholder the launch left in place (docbeam/placeholders.py)."""
    from docbeam import config as config_lib
    from docbeam import placeholders
    from docbeam.pipeline.store import output

    cfg = placeholders.expand(config_lib.load(launch.config, list(launch.sets)), output.new_run_id(), output.run_date())
    placeholders.refuse(cfg, placeholders.beam_options_of(cfg, launch.beam_args))


def profile_path(config: str) -> str:
    """A relative profile is looked up in the working folder, then beside this package (the image's
    /opt/docbeam/configs), since the launcher's working folder is not ours to choose."""
    if os.path.isabs(config) or os.path.exists(config):
        return config
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above pipeline/driver/
    return os.path.join(repo, config)


def main(argv: list[str] | None = None) -> int:
    from docbeam.errors import Refused
    from docbeam.pipeline.driver import cli

    launch = parse(sys.argv[1:] if argv is None else argv)
    try:
        refuse_placeholders(launch)
    except Refused as e:
        print(f"docbeam: cannot start: {e} ({type(e).__name__}; nothing was touched)", file=sys.stderr)
        return 2
    return cli.main(launch.run_args())


if __name__ == "__main__":
    sys.exit(main())
