"""``python -m docbeam``: the command line."""

from docbeam.pipeline.driver.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
