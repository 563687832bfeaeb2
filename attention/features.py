"""Every optional thing a layer may ask of attention, each declared once, in ``DECLARED``.

A feature has one ``name``: the ``register()`` keyword and ``Backend`` declaration (``segments=True``), the
field an ``AttentionCase`` or ``AttentionFeatures`` carries (``case.segments``), a plain function's
``supports_<name>`` attribute, the key of a flash kernel's ``takes`` / ``cannot``. ``keyword`` is the
AttentionFn argument that hands it over: the name, except for a tensor, whose name carries its shape
(``segment_ids_BxT``). The plan's refusals, bind's checks, flash's kernel refusals and the docs' feature table
are all read from here, so adding a feature is one ``Feature`` plus the kernels that take it: a backend that
does not declare it is refused every case that asks for it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    keyword: str | None  # the AttentionFn argument that carries it; None: carried by the shapes of k and v
    column: str  # its column in flash's kernel feature table (docs/attention.md)
    refusal: str  # why the plan refuses a backend without it; formatted with ``case``
    kernel_refusal: str  # why a flash kernel without it refuses; formatted with ``kernel`` (its name)
    describe: Callable[[Any], str] = lambda value: ""  # how a kind of layer asking for it is named; "": not
    default: Any = False  # a case's value when nothing asks; None for a feature whose value is a setting
    per_layer: bool = True  # asked by a kind of layer; False: by the whole batch (packed rows)
    static: bool = True  # a Python value or function closed over by jit, not an array argument
    needed: Callable[[Any], bool] | None = None  # whether a case asks for it; None: its field is set
    probe: Callable[[Any, Any, int], Any] | None = None  # (case, lengths_B, seed) → the probe batch's argument;
    # None: the case's own value (a window as it is, causal=True)

    def asked_by(self, case) -> bool:
        if self.needed is not None:
            return self.needed(case)
        return getattr(case, self.name) not in (None, False)

    def case_value(self, argument):
        """The case's field for the AttentionFn argument a layer passed: a setting as it is, else whether
        it was passed."""
        return argument if self.default is None else argument is not None and argument is not False

    def probe_argument(self, case, lengths_B, seed: int):
        """What the start-up probe (attention/dispatch.py) hands a backend for a case asking for this feature."""
        return getattr(case, self.name) if self.probe is None else self.probe(case, lengths_B, seed)

    def refuse(self, case) -> str:
        return f"{self.refusal.format(case=case)}; register it with {self.name}=True"


def probe_segment_ids(case, lengths_B, seed: int):
    """Two windows in every other row (the second from a third of the way in), padding 0."""
    import jax.numpy as jnp
    import numpy as np

    del seed
    positions_BxT = np.arange(case.seq_len)[None, :]
    valid_BxT = positions_BxT < lengths_B[:, None]
    second_BxT = (positions_BxT >= max(1, case.seq_len // 3)) & (np.arange(len(lengths_B)) % 2 == 0)[:, None]
    return jnp.asarray(valid_BxT * (1 + second_BxT), jnp.int32)


def probe_bias(case, lengths_B, seed: int):
    """A random relative-position bias, ``bias(q_index_T, k_index_S) -> [N, T, S]``: one value per head and
    offset (what MPNet's buckets and ALiBi are special cases of), large enough to move the output."""
    import jax.numpy as jnp
    import numpy as np

    del lengths_B
    table_NxD = np.random.default_rng(seed).standard_normal((case.num_heads, 2 * case.seq_len - 1)).astype(np.float32)

    def bias(q_index_T, k_index_S):
        return jnp.asarray(table_NxD)[:, k_index_S[None, :] - q_index_T[:, None] + case.seq_len - 1]

    return bias


def probe_relative_positions(case, lengths_B, seed: int):
    from docbeam.attention.relative import random_relative

    del lengths_B
    return random_relative(case.num_heads, case.head_dim, case.seq_len, seed)


DECLARED: dict[str, Feature] = {
    feature.name: feature
    for feature in (
        Feature(
            "local_window",
            "local_window",
            "local windows",
            "it takes no local window, which this model's local layers need ({case.local_window[0]} keys left, "
            "{case.local_window[1]} right)",
            "{kernel} has no local-window mask (ModernBERT's local layers need one)",
            describe=lambda window: f"local window {window}" if window else "global",
            default=None,
        ),
        Feature(
            "bias",
            "bias",
            "per-head bias",
            "it takes no additive per-head bias, which this model's layers add (relative positions)",
            "{kernel} adds no per-head bias (relative-position models need one)",
            describe=lambda on: "per-head bias" if on else "",
            probe=probe_bias,
        ),
        Feature(
            "segments",
            "segment_ids_BxT",
            "segment ids (packing)",
            "it takes no segment ids, which packed rows need (or set batching.packing: false)",
            "{kernel} takes no segment ids (packed rows need them)",
            per_layer=False,
            static=False,
            probe=probe_segment_ids,
        ),
        Feature(
            "causal",
            "causal",
            "causal",
            "it takes no causal mask, which this decoder model's layers need",
            "{kernel} has no causal mask here (decoder models need one)",
            describe=lambda on: "causal" if on else "",
        ),
        Feature(
            "grouped",
            None,
            "grouped-query k/v",
            "it takes no grouped-query k/v ({case.num_heads} query heads over {case.kv_heads} key/value heads)",
            "{kernel} takes as many k/v heads as q heads (grouped-query decoders have fewer, and repeating them "
            "is the memory the kernel exists to save)",
            per_layer=False,
            needed=lambda case: case.kv_heads != case.num_heads,
        ),
        # No kernel but docbeam's chunked has a place for a content-dependent term: each would need it as a dense bias.
        Feature(
            "relative_positions",
            "relative_positions",
            "relative positions (c2p/p2c)",
            "it takes no content-dependent relative positions, which this model's layers add (DeBERTa's "
            "content-to-position and position-to-content terms)",
            "{kernel} scores only q·k plus at most a dense bias: DeBERTa's content-to-position and "
            "position-to-content terms would be a [B, N, T, S] array; flash's chunked kernel computes them per "
            "block (attention.backend: chunked)",
            describe=lambda on: "disentangled relative positions" if on else "",
            probe=probe_relative_positions,
        ),
    )
}

# Names a feature had before it had one: accepted with a DeprecationWarning, until user backends move.
RENAMED = {"packed": "segments", "windows": "local_window", "relative": "relative_positions"}


def named(name: str, where: str) -> Feature:
    """The feature called ``name`` (an old name warns); an unknown one raises, naming ``where`` it was met."""
    if name in RENAMED:
        warnings.warn(
            f"{where}: {name!r} is now called {RENAMED[name]!r}; the old name will stop working",
            DeprecationWarning,
            stacklevel=3,
        )
        name = RENAMED[name]
    if name not in DECLARED:
        raise TypeError(
            f"{where}: unknown attention feature {name!r}; declared: {', '.join(DECLARED)} (attention/features.py)"
        )
    return DECLARED[name]


def by_keyword(keyword: str, where: str) -> Feature:
    """The feature an AttentionFn argument carries; an unknown argument raises (a typo must not be dropped)."""
    for feature in DECLARED.values():
        if feature.keyword == keyword:
            return feature
    raise TypeError(
        f"{where} got an unknown argument {keyword!r}; known: "
        f"{', '.join(f.keyword for f in DECLARED.values() if f.keyword)}"
    )


def declared(flags: dict[str, bool], where: str) -> frozenset[str]:
    """The names of the features a backend declares with ``name=True`` (register's keywords)."""
    return frozenset(named(key, where).name for key, on in flags.items() if on)


def declared_by(fn, where: str) -> frozenset[str]:
    """What a plain AttentionFn declares with ``supports_<name> = True`` attributes (old names too)."""
    return declared({name: bool(getattr(fn, f"supports_{name}", False)) for name in [*DECLARED, *RENAMED]}, where)


def refusals(case, takes: frozenset[str]) -> list[str]:
    """The plan's reason for every feature ``case`` asks for that is not in ``takes``."""
    return [f.refuse(case) for f in DECLARED.values() if f.asked_by(case) and f.name not in takes]


def static_keywords() -> tuple[str, ...]:
    """Arguments closed over by a jitted call, never its array arguments."""
    return tuple(f.keyword for f in DECLARED.values() if f.static and f.keyword)
