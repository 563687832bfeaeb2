"""The one signature every attention backend implements, and how a backend says what it can run.

Layout is ``[batch, seq, heads, head_dim]`` (BTNH) for q, k, v and the output. Padding is always on the
right (the bucketer pads sequences at the end), so it travels as per-row valid lengths: kernels disagree
on mask formats (boolean masks, segment ids, sequence lengths) and each adapter converts from this one.

What else a call may carry is declared once per feature in attention/features.py (the name a backend
registers, the argument, the refusal); a backend is handed only what it declares, and the plan refuses the
cases that ask for more. What each one means:
- ``segment_ids_BxT`` (feature ``segments``): with ``batching.packing`` a row holds several windows one after
  another, told apart by segment ids (1, 2, … per window, 0 for padding; a token attends only to its own window).
- ``local_window=(left, right)``: query i attends only keys i-left ≤ j ≤ i+right (ModernBERT's local layers,
  ±64). Static Python ints, so a kernel can skip whole key blocks outside the window.
- ``bias``: an additive per-head score bias, ``bias(q_index_T, k_index_S) -> bias_NxTxS`` (float32), a pure
  JAX function of row indices (MPNet's relative-position buckets; ALiBi later). A backend calls it for the
  blocks it computes, so no ``[B, N, T, S]`` tensor need exist. Packed windows are contiguous, so an index
  difference inside one window is a position difference, and pairs across windows are masked anyway.
- ``causal=True``: query i attends only keys j ≤ i (decoder models: Qwen3), inside its own packed window.
- grouped-query attention: k and v may carry fewer heads K than q's N (N a multiple of K; query head n reads
  key/value head n // (N / K)), as decoders store them: a backend never needs them repeated.
- ``relative_positions``: content-dependent relative positions (DeBERTa's disentangled attention), an
  attention/relative.py ``RelativePositions``: the family's projected relative embeddings
  (``pos_key_RxNxH`` for content→position, ``pos_query_RxNxH`` for position→content) and ``row(offset)``, its
  bucketing of query − key offsets; the backend adds ``q_i · pos_key[row(i−j)] + k_j · pos_query[row(i−j)]``,
  scaled like q·k, computing it per block from the rows the block reaches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import pydantic

from docbeam.attention.features import DECLARED, RENAMED, by_keyword, declared, named, refusals


class AttentionFn(Protocol):
    """``attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale) -> out_BxTxNxH``.

    Keys at positions ``>= kv_lengths_B[b]`` get zero weight. Query rows past the length are padding:
    their values are ignored downstream but must be finite. A backend that declares ``segments`` is also
    called with ``segment_ids_BxT`` on packed batches: then key s has weight for query t only where
    both carry the same segment id.
    """

    def __call__(
        self, q_BxTxNxH: Any, k_BxSxNxH: Any, v_BxSxNxH: Any, *, kv_lengths_B: Any, scale: float, **features: Any
    ) -> Any: ...


@dataclasses.dataclass(frozen=True, init=False)
class AttentionFeatures:
    """What attention is asked beyond plain padding, by feature name (attention/features.py): what one kind of
    layer asks (ModernBERT: global and local layers), or, inside a case, its whole bucket. Each declared
    feature reads as an attribute, its default where nothing asks for it (``features.local_window``)."""

    asked: tuple[tuple[str, Any], ...]  # (name, value) of each feature asked for, by name

    def __init__(self, asked=(), **values):
        values = {
            named(name, "AttentionFeatures").name: value for name, value in [*dict(asked).items(), *values.items()]
        }
        object.__setattr__(
            self,
            "asked",
            tuple(
                sorted(
                    ((name, value) for name, value in values.items() if value != DECLARED[name].default),
                    key=lambda item: item[0],
                )
            ),
        )

    def __getattr__(self, name: str):
        if name not in DECLARED and name not in RENAMED:  # pickle asks before asked is set
            raise AttributeError(f"{type(self).__name__} has no {name!r}; features: {', '.join(DECLARED)}")
        feature = named(name, "AttentionFeatures")
        return dict(self.asked).get(feature.name, feature.default)

    def of_layer(self) -> "AttentionFeatures":
        """Only what a kind of layer asks (not what its whole batch does: packed rows)."""
        return AttentionFeatures([(name, v) for name, v in self.asked if DECLARED[name].per_layer])

    def describe(self) -> str:
        parts = (f.describe(getattr(self, f.name)) for f in DECLARED.values() if f.per_layer)
        return ", ".join(part for part in parts if part)


def current_platform() -> str:
    """The platform this trace will run on, for a backend that picks its formulation at trace time (its
    capability check saw the same platform): a ``jax.default_device`` in force (e.g. runner.device: cpu on
    a GPU machine) wins over the default backend."""
    import jax

    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


@dataclasses.dataclass(frozen=True, init=False)
class AttentionCase:
    """One shape the encoder will call attention with: what a capability check is asked about. Rows may always
    be shorter than seq_len: padding is part of every case. Each declared feature reads as an attribute
    (``case.local_window``, ``case.segments``); ``AttentionCase(..., causal=True)`` asks for one."""

    platform: str  # "cpu" | "gpu" | "tpu", as jax.default_backend() names them
    dtype: str  # "float32" | "bfloat16" | "float16"
    seq_len: int
    num_heads: int
    head_dim: int
    num_kv_heads: int | None  # grouped-query attention: k/v heads, fewer than num_heads; None: as many
    features: AttentionFeatures  # what every layer of the case asks for, and what its kind of layer does

    def __init__(
        self,
        platform: str,
        dtype: str,
        seq_len: int,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int | None = None,
        features: AttentionFeatures | None = None,
        **asked,
    ):
        for name, value in (
            ("platform", platform),
            ("dtype", dtype),
            ("seq_len", seq_len),
            ("num_heads", num_heads),
            ("head_dim", head_dim),
            ("num_kv_heads", num_kv_heads),
            ("features", AttentionFeatures((features or AttentionFeatures()).asked, **asked)),
        ):
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        if name not in DECLARED and name not in RENAMED:  # pickle asks before features is set
            raise AttributeError(f"AttentionCase has no {name!r}")
        return getattr(self.features, name)

    @classmethod
    def of_call(cls, q_BxTxNxH, k_BxSxKxH, **arguments) -> "AttentionCase":
        """The case an AttentionFn call is: its shapes, dtype and the features its arguments ask for."""
        import jax.numpy as jnp

        b, t, n, h = q_BxTxNxH.shape
        asked = {by_keyword(key, "attention").name: value for key, value in arguments.items()}
        return cls(
            current_platform(),
            jnp.dtype(q_BxTxNxH.dtype).name,
            max(t, k_BxSxKxH.shape[1]),
            n,
            h,
            num_kv_heads=k_BxSxKxH.shape[2],
            **{name: DECLARED[name].case_value(value) for name, value in asked.items()},
        )

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def with_features(self, layer: AttentionFeatures) -> "AttentionCase":
        """This case for one kind of layer: its batch's features kept, the layer's replaced by ``layer``'s."""
        kept = [(name, value) for name, value in self.features.asked if not DECLARED[name].per_layer]
        return dataclasses.replace(self, features=AttentionFeatures(kept + list(layer.of_layer().asked)))


@dataclasses.dataclass(frozen=True)
class Support:
    """A backend's answer for one case: whether it runs, which kernel, and if not, why not."""

    ok: bool
    kernel: str = ""
    reason: str = ""


class NoOptions(pydantic.BaseModel):
    """Options of a backend that takes none: any key under it is a typo, so it is refused."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


def supports_everything(case: AttentionCase, options: pydantic.BaseModel) -> Support:
    del case, options
    return Support(ok=True, kernel="")


@dataclasses.dataclass(frozen=True, init=False)
class Backend:
    """A registered backend: its attention function, its capability check, its typed options and the
    features it takes (``takes``, names from attention/features.py; ``Backend(..., segments=True)`` declares one,
    ``backend.segments`` reads it).

    ``attend`` takes the AttentionFn arguments plus ``options`` (an instance of ``options_type``).
    """

    name: str
    attend: Callable[..., Any]
    supports: Callable[[AttentionCase, pydantic.BaseModel], Support]
    options_type: type[pydantic.BaseModel]
    description: str
    takes: frozenset[str]

    def __init__(
        self,
        name: str,
        attend: Callable[..., Any],
        supports: Callable[[AttentionCase, pydantic.BaseModel], Support] = supports_everything,
        options_type: type[pydantic.BaseModel] = NoOptions,
        description: str = "",
        takes: frozenset[str] = frozenset(),
        **flags: bool,
    ):
        takes = frozenset(named(n, f"attention backend {name!r}").name for n in takes)
        for key, value in (
            ("name", name),
            ("attend", attend),
            ("supports", supports),
            ("options_type", options_type),
            ("description", description),
            ("takes", takes | declared(flags, f"attention backend {name!r}")),
        ):
            object.__setattr__(self, key, value)

    def __getattr__(self, name: str) -> bool:
        """``backend.segments``: whether it declares that feature."""
        if name not in DECLARED and name not in RENAMED:  # pickle asks before takes is set
            raise AttributeError(f"Backend has no {name!r}")
        return named(name, f"attention backend {self.name!r}").name in self.takes

    def refusal(self, case: AttentionCase) -> Support | None:
        """What the plan answers for this backend before asking its own check: a case needing a feature the
        backend did not declare."""
        reasons = refusals(case, self.takes)
        return Support(ok=False, reason="; ".join(reasons)) if reasons else None

    def parse_options(self, raw: dict | None) -> pydantic.BaseModel:
        return self.options_type.model_validate(raw or {})

    def bind(self, options: pydantic.BaseModel | None = None) -> AttentionFn:
        """An AttentionFn with options fixed, inside ``attention/<name>`` so profiler traces name it."""
        import jax

        opts = options if options is not None else self.parse_options(None)
        scope = f"attention/{self.name}"

        def attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, **arguments):
            arguments = {key: value for key, value in arguments.items() if value is not None and value is not False}
            case = AttentionCase.of_call(q_BxTxNxH, k_BxSxNxH, **arguments)
            missing = [f for f in DECLARED.values() if f.asked_by(case) and f.name not in self.takes]
            if missing:
                raise ValueError(
                    f"attention backend {self.name!r} takes no "
                    f"{', '.join(f.keyword or f.column for f in missing)} "
                    f"(it is not registered with {', '.join(f.name + '=True' for f in missing)}); "
                    "the plan should have refused this case for it"
                )
            with jax.named_scope(scope):
                return self.attend(
                    q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B, scale=scale, options=opts, **arguments
                )

        attend.__name__ = f"attend_{self.name}"
        attend.backend_name = self.name
        return attend
