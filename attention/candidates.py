"""``attention.backend: auto``'s candidates: a registered backend's name, ``name[kernel]`` for one kernel of a
backend whose options pick one (``flash[cudnn]``), or a user's ``package.module:function``; how each is bound."""

from __future__ import annotations

import typing

import pydantic

from docbeam.attention import registry

AUTO = "auto"
NATIVE = "native"


def split_label(label: str) -> tuple[str, str | None]:
    """``flash[chunked]`` → ("flash", "chunked"); ``native`` → ("native", None)."""
    if label.endswith("]") and "[" in label:
        name, _, kernel = label[:-1].partition("[")
        return name, kernel
    return label, None


def kernels_of(name: str) -> tuple[str, ...]:
    """The values of a backend's ``kernel`` option other than ``auto`` (flash's kernels); () when it has none."""
    field = registry.get(name).options_type.model_fields.get("kernel")
    if field is None:
        return ()
    return tuple(v for v in typing.get_args(field.annotation) if isinstance(v, str) and v != AUTO)


def check_label(label: str) -> str:
    """``label`` if it names a registered backend (or a kernel of one); else ValueError naming the valid ones."""
    name, kernel = split_label(label)
    if name == AUTO:
        raise ValueError("attention.candidates: 'auto' is what chooses among the candidates, not one of them")
    registry.get(name)  # UnknownBackendError names the valid backends
    if kernel is not None and kernel not in kernels_of(name):
        offered = kernels_of(name)
        raise ValueError(
            f"attention.candidates: {label!r}: backend {name!r} "
            + (f"has no kernel {kernel!r}; its kernels: {', '.join(offered)}" if offered else "has no kernel option")
        )
    return label


def default_candidates() -> tuple[str, ...]:
    """Every registered backend (entry-point plug-ins included); a backend with kernels as each of its kernels."""
    labels = []
    names = registry.names()
    for name in names:
        # a kernel that is a backend of its own (flash's chunked) is measured once, as that backend
        kernels = [k for k in kernels_of(name) if k not in names]
        labels += [f"{name}[{k}]" for k in kernels] if kernels_of(name) else [name]
    return tuple(labels)


def options_of(spec, label: str) -> pydantic.BaseModel:
    """The candidate's typed options: its backend's section of the spec, with ``kernel`` set for ``name[kernel]``."""
    name, kernel = split_label(label)
    options = spec.options_for(name)
    if kernel is None:
        return options
    return type(options).model_validate({**options.model_dump(), "kernel": kernel})


def bind(spec, label: str):
    """The AttentionFn of a candidate (or of any backend name) with its options from the spec."""
    return registry.get(split_label(label)[0]).bind(options_of(spec, label))
