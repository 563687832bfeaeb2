"""Backends by name: built-ins, Python entry points (group ``docbeam.attention``) and
``package.module:function`` strings from YAML all end up in one dict.

The built-ins register themselves with ``register`` when the ``attention`` package is imported (which
happens before this module can be used), so nothing here imports a backend: no import loop."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import logging
from typing import Callable

from docbeam.attention.features import declared_by
from docbeam.attention.interface import Backend, NoOptions, Support, supports_everything
from docbeam.errors import Refused

ENTRY_POINT_GROUP = "docbeam.attention"
_REGISTRY: dict[str, Backend] = {}
_entry_points_loaded = False


class UnknownBackendError(Refused, ValueError):
    pass


def register(
    name: str, *, options: type = NoOptions, supports: Callable | None = None, description: str = "", **declares: bool
):
    """Decorator: ``@register("mine") def attend(q, k, v, *, kv_lengths_B, scale, options)``; each
    ``<feature>=True`` (a name declared in attention/features.py, e.g. ``segments=True``) declares a feature the
    function takes, so it is handed that feature's argument; an undeclared name raises, naming the declared ones."""

    def decorate(fn):
        add(
            Backend(
                name=name,
                attend=fn,
                supports=supports or supports_everything,
                options_type=options,
                description=description or (fn.__doc__ or "").strip().split("\n")[0],
                **declares,
            )
        )
        return fn

    return decorate


def add(backend: Backend) -> Backend:
    if backend.name in _REGISTRY:
        raise ValueError(
            f"attention backend {backend.name!r} is registered twice "
            f"(first by {_REGISTRY[backend.name].attend.__module__}); pick another name"
        )
    _REGISTRY[backend.name] = backend
    return backend


def from_callable(name: str, obj) -> Backend:
    """A Backend from a user's object: a Backend as is, or a plain AttentionFn (its optional
    ``supports(case, options)`` attribute is its capability check; ``supports_<feature> = True`` declares a
    feature of attention/features.py, e.g. ``supports_segments`` for ``segment_ids_BxT``)."""
    if isinstance(obj, Backend):
        return dataclasses.replace(obj, name=name)  # registered under the name the config uses
    if not callable(obj):
        raise TypeError(
            f"attention backend {name!r} is {obj!r}, which is not callable; it must be an "
            "AttentionFn: attend(q, k, v, *, kv_lengths_B, scale)"
        )

    def attend(q, k, v, *, kv_lengths_B, scale, options, **features):
        del options
        return obj(q, k, v, kv_lengths_B=kv_lengths_B, scale=scale, **features)

    attend.__wrapped__ = obj  # the user's own function: its module is what auto's measurement cache digests
    supports = getattr(obj, "supports", None) or supports_everything
    return Backend(
        name=name,
        attend=attend,
        supports=supports,
        options_type=NoOptions,
        description=(obj.__doc__ or f"user backend {name}").strip().split("\n")[0],
        takes=declared_by(obj, f"attention backend {name!r}"),
    )


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _REGISTRY:
            logging.getLogger(__name__).warning(
                "entry point %s = %s (group %s) is ignored: the name is taken by %s",
                ep.name,
                ep.value,
                ENTRY_POINT_GROUP,
                _REGISTRY[ep.name].attend.__module__,
            )
            continue
        try:
            _REGISTRY[ep.name] = from_callable(ep.name, ep.load())
        except Exception as e:  # a broken plug-in disables itself, not the job
            _REGISTRY[ep.name] = Backend(
                name=ep.name,
                attend=_unavailable(ep.name),
                supports=lambda case, options, e=e, ep=ep: Support(
                    ok=False, reason=f"entry point {ep.value} failed to load: {type(e).__name__}: {e}"
                ),
            )


def _unavailable(name):
    def attend(*args, **kwargs):
        raise RuntimeError(f"attention backend {name!r} is unavailable; see its capability check")

    return attend


def load_spec(spec: str) -> Backend:
    """``package.module:function`` → Backend, registered under the spec string itself."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise UnknownBackendError(
            f"attention.backend: cannot import {spec!r} ({type(e).__name__}: {e}); "
            "a user backend is written 'package.module:function'"
        ) from e
    return add(from_callable(spec, obj))


def get(name: str) -> Backend:
    """The backend for a name or a ``module:function`` spec; unknown names raise with the valid ones."""
    _load_entry_points()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return load_spec(name)
    raise UnknownBackendError(
        f"attention.backend: unknown backend {name!r}; valid: {', '.join(names())} "
        "or a 'package.module:function' string"
    )


def names() -> list[str]:
    _load_entry_points()
    return sorted(n for n in _REGISTRY if ":" not in n)
