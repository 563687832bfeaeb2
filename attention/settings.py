"""The job's ``attention`` section, validated once at config load into the one typed object every consumer uses:
the driver's plan, the parity gate, and each worker (pickled to it as it is).

It lives in attention/ because attention/ imports nothing of docbeam's config; docbeam/config.py uses this class
as the section's type. Each backend's options are written nested under its name
(``attention: {backend: flash, flash: {block_q: 256}}``) and parsed here into that backend's typed options.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic

from docbeam.attention import registry
from docbeam.errors import readable


class AttentionConfig(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)  # as every other section of the job's YAML

    backend: str = "native"  # a backend's name, ``package.module:function``, or auto (attention/measure.py)
    fallback: str | None = None  # runs the buckets `backend` cannot; None: such a job fails at start
    # backend auto: what is measured against native per bucket (``flash[chunked]``: one kernel of flash); None:
    # every registered backend, each of flash's kernels
    candidates: tuple[str, ...] | None = None
    verify: pydantic.StrictBool = False  # run a probe batch per bucket against native before the main work
    verify_tolerance: pydantic.PositiveFloat | None = None  # None: 1e-5 for float32, 2e-2 for bfloat16
    on_mismatch: Literal["fail", "fallback"] = "fail"
    # Typed options per backend, parsed from the sections nested under a backend's name; not a YAML key itself.
    backend_options: dict[str, Any] = pydantic.Field(default={}, exclude=True)

    @pydantic.model_validator(mode="before")
    @classmethod
    def _parse_backend_sections(cls, raw):
        """Each backend's options are written in one place, nested under its name, and parsed here once
        into that backend's typed options."""
        if not isinstance(raw, dict):
            return raw
        for key in ("options", "backend_options"):
            if key in raw:
                raise ValueError(
                    f"attention.{key} is not a key: nest a backend's options under its name, e.g. "
                    "attention: {backend: flash, flash: {block_q: 256}}"
                )
        fields = set(cls.model_fields)
        sections = {k: v for k, v in raw.items() if k not in fields and k in registry.names()}
        parsed = {}
        for name, section in sections.items():
            try:
                parsed[name] = registry.get(name).parse_options(section)
            except pydantic.ValidationError as e:
                raise ValueError(readable(e, prefix=f"attention.{name}")) from None
        rest = {k: v for k, v in raw.items() if k not in sections}
        return {**rest, "backend_options": parsed}

    @pydantic.model_validator(mode="after")
    def _check_backends(self):
        from docbeam.attention import candidates as measure

        auto = self.backend == measure.AUTO
        for key, name in (("backend", self.backend), ("fallback", self.fallback)):
            if name is None or (key == "backend" and auto):
                continue
            try:
                registry.get(name)
            except (registry.UnknownBackendError, TypeError) as e:
                raise ValueError(str(e).replace("attention.backend", f"attention.{key}", 1)) from None
        if auto and self.fallback not in (None, measure.NATIVE):
            raise ValueError(
                f"attention.fallback: {self.fallback!r} with attention.backend: auto; auto runs native wherever no "
                "candidate is measured faster and correct, so its fallback is native: set fallback: native or remove it"
            )
        if self.candidates is not None and not auto:
            raise ValueError(
                f"attention.candidates is read only with attention.backend: auto (it is {self.backend!r}); "
                "remove it, or set backend: auto"
            )
        for label in self.candidates or ():
            try:
                measure.check_label(label)
            except (registry.UnknownBackendError, TypeError) as e:
                raise ValueError(str(e).replace("attention.backend", "attention.candidates", 1)) from None
        if self.candidates is not None and not self.candidates:
            raise ValueError("attention.candidates: an empty list measures nothing; list backends, or remove the key")
        running = {self.backend, self.fallback}
        if auto:  # native always: the reference and the tie's winner
            running |= {
                measure.NATIVE,
                *(measure.split_label(c)[0] for c in self.candidates or measure.default_candidates()),
            }
        unused = sorted(set(self.backend_options) - running)
        if unused:
            raise ValueError(
                f"attention.{unused[0]}: options for backend {unused[0]!r}, which this job does not run "
                f"(attention.backend is {self.backend!r}, attention.fallback {self.fallback!r}); "
                f"remove them, or set attention.backend or attention.fallback to {unused[0]!r}"
            )
        return self

    @pydantic.model_serializer(mode="wrap")
    def _nest_backend_sections(self, handler, info):
        """Dumped as written: each backend's options under its name, so a dump loads back unchanged."""
        out = handler(self)
        out.update({name: options.model_dump(mode=info.mode) for name, options in self.backend_options.items()})
        return out

    def __hash__(self) -> int:
        # The workers key their probes and their warm encoder by it; pydantic's frozen hash cannot hash the dict.
        fields = (self.backend, self.fallback, self.candidates, self.verify, self.verify_tolerance, self.on_mismatch)
        return hash((fields, tuple(sorted(self.backend_options.items()))))

    def options_for(self, name: str) -> pydantic.BaseModel:
        """The typed options of backend ``name``: its section's, or its defaults (the only sections are those
        of ``backend`` and ``fallback``)."""
        if name in self.backend_options:
            return self.backend_options[name]
        return registry.get(name).parse_options(None)
