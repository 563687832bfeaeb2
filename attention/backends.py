"""Importing this module registers the built-in backends. Each lives in its own file with its
platform workarounds; kernel libraries are imported lazily inside them, so a missing or broken kernel
package shows up as that backend's capability-check reason instead of an import error here."""

from docbeam.attention import (
    chunked,  # noqa: F401
    flash,  # noqa: F401
    native,  # noqa: F401
)
