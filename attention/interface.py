"""The one signature every attention backend implements, and how a backend says what it can run.

Layout is ``[batch, seq, heads, head_dim]`` (BTNH) for q, k, v and the output. Padding is always on the
right (the bucketer pads sequences at the end), so it travels as per-row valid lengths: kernels disagree
on mask formats (boolean masks, segment ids, sequence lengths) and each adapter converts from this one.

With ``batching.packing`` a row holds several windows one after another, told apart by segment ids
(``segment_ids_BxT``: 1, 2, … per window, 0 for padding; a token attends only to its own window). Only
backends registered with ``segments=True`` are handed them; the plan refuses packed cases for the others.

Model families add two more things a layer may ask of attention, each declared per backend the same way:
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
A layer passes only the ones it uses; a backend is never handed a feature it did not declare.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import pydantic


class AttentionFn(Protocol):
    """``attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale) -> out_BxTxNxH``.

    Keys at positions ``>= kv_lengths_B[b]`` get zero weight. Query rows past the length are padding:
    their values are ignored downstream but must be finite. A backend that declares ``segments`` is also
    called with ``segment_ids_BxT`` on packed batches: then key s has weight for query t only where
    both carry the same segment id.
    """

    def __call__(self, q_BxTxNxH: Any, k_BxSxNxH: Any, v_BxSxNxH: Any, *, kv_lengths_B: Any,
                 scale: float, **features: Any) -> Any: ...


# The optional keyword arguments of an AttentionFn, and the Backend flag that declares each.
FEATURE_FLAGS = {"segment_ids_BxT": "segments", "local_window": "windows", "bias": "bias", "causal": "causal",
                 "relative_positions": "relative"}


@dataclasses.dataclass(frozen=True)
class AttentionFeatures:
    """What one kind of layer asks of attention beyond plain padding: a model has one or a few kinds
    (ModernBERT: global and local layers), and the plan asks the capability check about each."""

    local_window: tuple[int, int] | None = None  # (left, right) keys each side; None: global
    bias: bool = False  # an additive per-head bias function
    causal: bool = False  # keys after the query get no weight
    relative: bool = False  # content-dependent relative positions (relative_positions: DeBERTa's c2p/p2c)

    def describe(self) -> str:
        parts = [f"local window {self.local_window}" if self.local_window else "global"]
        return ", ".join(parts + (["per-head bias"] if self.bias else []) + (["causal"] if self.causal else [])
                         + (["disentangled relative positions"] if self.relative else []))


def current_platform() -> str:
    """The platform this trace will run on, for a backend that picks its formulation at trace time (its
    capability check saw the same platform): a ``jax.default_device`` in force (e.g. runner.device: cpu on
    a GPU machine) wins over the default backend."""
    import jax

    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return device if isinstance(device, str) else device.platform


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One shape the encoder will call attention with: what a capability check is asked about."""

    platform: str  # "cpu" | "gpu" | "tpu", as jax.default_backend() names them
    dtype: str  # "float32" | "bfloat16" | "float16"
    seq_len: int
    num_heads: int
    head_dim: int  # rows may always be shorter than seq_len: padding is part of every case
    packed: bool = False  # batching.packing: rows carry several windows, told apart by segment ids
    local_window: tuple[int, int] | None = None  # AttentionFeatures.local_window of the layers asked about
    bias: bool = False  # those layers add a per-head bias
    causal: bool = False  # those layers are causal
    num_kv_heads: int | None = None  # grouped-query attention: k/v heads, fewer than num_heads; None: as many
    relative: bool = False  # those layers add content-dependent relative positions (relative_positions)

    @property
    def features(self) -> AttentionFeatures:
        return AttentionFeatures(self.local_window, self.bias, self.causal, self.relative)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def with_features(self, features: AttentionFeatures) -> "AttentionCase":
        return dataclasses.replace(self, local_window=features.local_window, bias=features.bias,
                                   causal=features.causal, relative=features.relative)


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


@dataclasses.dataclass(frozen=True)
class Backend:
    """A registered backend: its attention function, its capability check and its typed options.

    ``attend`` takes the AttentionFn arguments plus ``options`` (an instance of ``options_type``).
    """

    name: str
    attend: Callable[..., Any]
    supports: Callable[[AttentionCase, pydantic.BaseModel], Support] = supports_everything
    options_type: type[pydantic.BaseModel] = NoOptions
    description: str = ""
    segments: bool = False  # takes segment_ids_BxT, so it can run packed batches
    windows: bool = False  # takes local_window=(left, right)
    bias: bool = False  # takes bias(q_index_T, k_index_S) -> bias_NxTxS
    causal: bool = False  # takes causal=True
    grouped: bool = False  # takes k/v with fewer heads than q (grouped-query attention)
    relative: bool = False  # takes relative_positions (attention/relative.py's RelativePositions)

    def refusal(self, case: AttentionCase) -> Support | None:
        """What the plan answers for this backend before asking its own check: a case needing a feature the
        backend did not declare."""
        if case.packed and not self.segments:
            return Support(ok=False, reason="it takes no segment ids, which packed rows (batching.packing: true) "
                                            "need; set batching.packing: false, or register it with segments=True")
        if case.local_window and not self.windows:
            return Support(ok=False, reason=f"it takes no local window, which this model's local layers need "
                                            f"({case.local_window[0]} keys left, {case.local_window[1]} right); "
                                            "register it with windows=True")
        if case.bias and not self.bias:
            return Support(ok=False, reason="it takes no additive per-head bias, which this model's layers add "
                                            "(relative positions); register it with bias=True")
        if case.causal and not self.causal:
            return Support(ok=False, reason="it takes no causal mask, which this decoder model's layers need; "
                                            "register it with causal=True")
        if case.relative and not self.relative:
            return Support(ok=False, reason="it takes no content-dependent relative positions, which this model's "
                                            "layers add (DeBERTa's content-to-position and position-to-content "
                                            "terms); register it with relative=True")
        if case.kv_heads != case.num_heads and not self.grouped:
            return Support(ok=False, reason=f"it takes no grouped-query k/v ({case.num_heads} query heads over "
                                            f"{case.kv_heads} key/value heads); register it with grouped=True")
        return None

    def parse_options(self, raw: dict | None) -> pydantic.BaseModel:
        return self.options_type.model_validate(raw or {})

    def bind(self, options: pydantic.BaseModel | None = None) -> AttentionFn:
        """An AttentionFn with options fixed, inside ``attention/<name>`` so profiler traces name it."""
        import jax

        opts = options if options is not None else self.parse_options(None)
        scope = f"attention/{self.name}"

        def attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, *, kv_lengths_B, scale, **features):
            features = {key: value for key, value in features.items() if value is not None and value is not False}
            if k_BxSxNxH.shape[2] != q_BxTxNxH.shape[2] and not self.grouped:
                raise ValueError(f"attention backend {self.name!r} takes no grouped-query k/v (q has "
                                 f"{q_BxTxNxH.shape[2]} heads, k {k_BxSxNxH.shape[2]}); the plan should have "
                                 "refused this case for it")
            for key in features:
                flag = FEATURE_FLAGS.get(key)
                if flag is None:
                    raise TypeError(f"attention got an unknown argument {key!r}; known: {', '.join(FEATURE_FLAGS)}")
                if not getattr(self, flag):
                    raise ValueError(f"attention backend {self.name!r} takes no {key} (it is not registered "
                                     f"with {flag}=True); the plan should have refused this case for it")
            with jax.named_scope(scope):
                return self.attend(q_BxTxNxH, k_BxSxNxH, v_BxSxNxH, kv_lengths_B=kv_lengths_B,
                                   scale=scale, options=opts, **features)

        attend.__name__ = f"attend_{self.name}"
        attend.backend_name = self.name
        return attend
