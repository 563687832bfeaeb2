"""Parity: every registered backend (plus the flash kernels that run on this machine, and both forms of
``native``) against softmax attention computed in numpy float64.

The backend sees inputs whose padded positions hold large garbage; the reference sees only the valid keys. Matching on the valid query rows therefore checks both
the numerics and that padded keys get zero weight. A case a backend's own check refuses is skipped, so every
backend must also accept the float32 standard cases (padding alone): one that refuses them fails, not skips; and
one that declares relative positions must run one of their cases on the CPU (tests/attention_fixtures.py).
"""

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_fixtures import assert_runs_a_declared_case

from docbeam import attention

USER_BACKEND = "tests.fixtures_user_backend:attend"
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str
    seq_len: int
    kv_lengths: tuple[int, ...]  # one per batch row
    num_heads: int
    head_dim: int

    def __str__(self):
        lengths = ",".join(map(str, self.kv_lengths))
        return f"{self.dtype}-T{self.seq_len}-len{lengths}-N{self.num_heads}H{self.head_dim}"


CASES = [
    Case("float32", 96, (96, 50, 0), num_heads=2, head_dim=32),  # full, partial, fully padded rows
    Case("float32", 200, (1, 200), num_heads=1, head_dim=64),  # not a multiple of 128; a single key
    Case("bfloat16", 128, (128, 77), num_heads=2, head_dim=32),
]

VARIANTS = [(name, {}) for name in attention.names()] + [
    ("native", {"implementation": "einsum"}),
    ("native", {"implementation": "jax_nn"}),
    ("flash", {"kernel": "tokamax_chunked"}),
    ("flash", {"kernel": "chunked"}),
    ("flash", {"kernel": "pallas_tpu", "interpret": True}),
    ("flash", {"kernel": "pallas_gpu", "interpret": True}),
    ("chunked", {"query_chunk": 64, "key_chunk": 48}),  # chunks that divide no sequence length
    ("chunked", {"heads_per_step": 0}),  # all heads in one batched matmul
    ("chunked", {"heads_per_step": 1, "query_chunk": 64, "key_chunk": 48}),  # one head per step, several chunks
    (USER_BACKEND, {}),
]


def variant_id(variant):
    name, options = variant
    return "-".join([name.split(":")[0].rsplit(".")[-1]] + [f"{k}={v}" for k, v in options.items()])


def parity_params():
    """Every variant on every case under jit, and on the first case eagerly too: eager calls compile
    op by op, which is what makes this file slow, and one case per backend shows that it traces."""
    for variant in VARIANTS:
        for case, jit in [(case, True) for case in CASES] + [(CASES[0], False)]:
            yield pytest.param(variant, case, jit, id=f"{variant_id(variant)}-{case}-{'jit' if jit else 'eager'}")


def tuned_params():
    """Each row of chunked's per-platform tables (CPU's per length, the accelerators' one default: the same
    arithmetic on any platform, so CPU checks them all), on a sequence just longer than its larger chunk (so
    both axes split into chunks, the last one partial) and with 3 heads (so 2 heads per step leaves a
    remainder)."""
    from docbeam.attention.chunk_sizes import PLATFORM_CHUNKS

    rows = {}  # chunks → the first table row naming them (the accelerators share one)
    for platform, table in PLATFORM_CHUNKS.items():
        for length, *chunks in table:
            rows.setdefault(tuple(chunks), f"{platform}-{length}" if len(table) > 1 else platform)
    for (query_chunk, key_chunk, heads_per_step), label in rows.items():
        seq_len = max(query_chunk, key_chunk) + 37
        case = Case("float32", seq_len, (seq_len, seq_len // 2 + 3), num_heads=3, head_dim=32)
        options = {"query_chunk": query_chunk, "key_chunk": key_chunk, "heads_per_step": heads_per_step}
        yield pytest.param(options, case, id=f"row{label}-" + "-".join(f"{k}={v}" for k, v in options.items()))


@functools.lru_cache
def make_inputs(case: Case, seed: int = 0):
    """q, k, v with garbage in the padded positions, and the float64 reference output on the valid keys.
    numpy makes the inputs: eager jax.random would compile op by op."""
    rng = np.random.default_rng(seed)
    shape = (len(case.kv_lengths), case.seq_len, case.num_heads, case.head_dim)
    valid_Bx1x1x1 = (np.arange(case.seq_len)[None, :] < np.array(case.kv_lengths)[:, None])[..., None, None]
    clean = [jnp.asarray(np.where(valid_Bx1x1x1, rng.standard_normal(shape), 0.0), case.dtype) for _ in "qkv"]
    garbage = [jnp.where(valid_Bx1x1x1, x, jnp.asarray(10 * rng.standard_normal(shape), case.dtype)) for x in clean]
    kv_lengths_B = jnp.array(case.kv_lengths, jnp.int32)
    q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in clean)
    reference = np.zeros(shape)
    for row, length in enumerate(case.kv_lengths):
        if length:
            scores_NxTxS = np.einsum("tnh,snh->nts", q[row], k[row, :length]) * case.head_dim**-0.5
            weights_NxTxS = np.exp(scores_NxTxS - scores_NxTxS.max(axis=-1, keepdims=True))
            weights_NxTxS /= weights_NxTxS.sum(axis=-1, keepdims=True)
            reference[row] = np.einsum("nts,snh->tnh", weights_NxTxS, v[row, :length])
    return garbage, kv_lengths_B, jnp.asarray(reference, jnp.float32)


@pytest.fixture
def tests_package_importable(monkeypatch):
    """The user backend is named ``tests.…``, importable from the repository root."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1]))


@pytest.mark.usefixtures("tests_package_importable")
@pytest.mark.parametrize("variant,case,jit", list(parity_params()))
def test_backend_matches_native_on_valid_rows_and_ignores_padding(variant, case, jit):
    name, raw_options = variant
    backend = attention.get(name)
    options = backend.parse_options(raw_options)
    support = backend.supports(
        attention.AttentionCase(
            platform=jax.default_backend(),
            dtype=case.dtype,
            seq_len=case.seq_len,
            num_heads=case.num_heads,
            head_dim=case.head_dim,
        ),
        options,
    )
    if not support.ok:
        pytest.skip(f"{name} {raw_options} cannot run {case} here: {support.reason}")

    (q, k, v), kv_lengths_B, reference = make_inputs(case)
    attend = backend.bind(options)
    if jit:
        attend = jax.jit(attend, static_argnames="scale")

    out_BxTxNxH = attend(q, k, v, kv_lengths_B=kv_lengths_B, scale=case.head_dim**-0.5)

    assert out_BxTxNxH.shape == q.shape and out_BxTxNxH.dtype == q.dtype
    assert bool(jnp.isfinite(out_BxTxNxH).all()), "non-finite output (padded or fully padded rows included)"
    for row, length in enumerate(case.kv_lengths):
        error = float(jnp.abs(out_BxTxNxH[row, :length].astype(jnp.float32) - reference[row, :length]).max(initial=0.0))
        assert error <= TOLERANCE[case.dtype], (
            f"row {row} (length {length}): max abs error {error:.2e} > {TOLERANCE[case.dtype]:.0e} against the float64 "
            "reference; either the numerics differ or padded keys got weight"
        )


def standard_refusals(name: str, raw_options: dict, platform: str) -> list[str]:
    """The float32 standard cases (padding alone, no feature) ``name``'s own check refuses on ``platform``, each
    with its reason. The test above skips a refused case, so a backend refusing these would never be compared."""
    backend = attention.get(name)
    options = backend.parse_options(raw_options)
    refused = []
    for case in (c for c in CASES if c.dtype == "float32"):
        asked = attention.AttentionCase(platform, case.dtype, case.seq_len, case.num_heads, case.head_dim)
        support = backend.refusal(asked) or backend.supports(asked, options)
        if not support.ok:
            refused.append(f"{case}: {support.reason}")
    return refused


def assert_compared(name: str, raw_options: dict, platform: str) -> None:
    refused = standard_refusals(name, raw_options, platform)
    assert not refused, (
        f"{name} {raw_options} refuses float32 standard cases on {platform}, so the parity test "
        f"would skip them and never compare it: {'; '.join(refused)}"
    )


@pytest.mark.usefixtures("tests_package_importable")
@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_every_backend_runs_the_float32_standard_cases_so_parity_compares_it(variant):
    assert_compared(*variant, jax.default_backend())


@pytest.mark.usefixtures("tests_package_importable")
def test_a_backend_that_refuses_every_case_fails_the_parity_check():
    refusing = "tests.fixtures_bad_backends:attend_refuses_everything"

    with pytest.raises(AssertionError, match=r"refuses float32 standard cases on cpu.*never compare.*not built"):
        assert_compared(refusing, {}, "cpu")

    assert len(standard_refusals(refusing, {}, "cpu")) == len([c for c in CASES if c.dtype == "float32"])
    assert_compared(USER_BACKEND, {}, "cpu")  # the same check passes a backend that runs them


@pytest.mark.parametrize("raw_options,case", list(tuned_params()))
def test_chunked_with_each_tuned_row_matches_reference(raw_options, case):
    backend = attention.get("chunked")
    (q, k, v), kv_lengths_B, reference = make_inputs(case)

    out_BxTxNxH = jax.jit(backend.bind(backend.parse_options(raw_options)), static_argnames="scale")(
        q, k, v, kv_lengths_B=kv_lengths_B, scale=case.head_dim**-0.5
    )

    for row, length in enumerate(case.kv_lengths):
        error = float(jnp.abs(out_BxTxNxH[row, :length] - reference[row, :length]).max())
        assert error <= TOLERANCE[case.dtype], f"row {row} (length {length}): max abs error {error:.2e}"


# --- content-dependent relative positions (DeBERTa's c2p and p2c; attention/relative.py) -----------------------

RELATIVE_TERMS = [("c2p",), ("p2c",), ("c2p", "p2c")]
RELATIVE_CASE = Case("float32", 70, (70, 41, 0), num_heads=3, head_dim=8)  # 3 heads: 2 per step leaves one
# Row 0 packs three windows, row 1 two and padding: a window's offsets are its own positions'.
RELATIVE_SEGMENTS = np.array([[1] * 20 + [2] * 45 + [3] * 5, [1] * 30 + [2] * 11 + [0] * 29, [0] * 70], np.int32)


def relative_case(packed: bool) -> attention.AttentionCase:
    case = RELATIVE_CASE
    return attention.AttentionCase(
        "cpu", case.dtype, case.seq_len, case.num_heads, case.head_dim, segments=packed, relative_positions=True
    )


def relative_variants():
    return [v for v in VARIANTS if v[0] != USER_BACKEND] + [
        ("chunked", {"query_chunk": 4, "key_chunk": 4}),  # Q + K − 1 = 7 offsets per block < 16 table rows
        ("chunked", {"query_chunk": 16, "key_chunk": 8, "heads_per_step": 2}),
    ]


def relative_params():
    """Every variant that declares relative positions, each term alone and both, unpacked and packed; chunked
    also with blocks smaller than the table (its gathered-rows path) and with two heads per step."""
    for variant in relative_variants():
        for terms in RELATIVE_TERMS:
            for packed in (False, True):
                yield pytest.param(
                    variant, terms, packed, id=f"{variant_id(variant)}-{'+'.join(terms)}{'-packed' if packed else ''}"
                )


def relative_reference(q, k, v, relative, case: Case, segments=None) -> np.ndarray:
    """float64 softmax(scale · (q_i·k_j + q_i·Kr[row(i−j)] + k_j·Qr[row(i−j)])) over the keys each valid query
    sees (its row's valid keys, or its own window's)."""
    t = case.seq_len
    rows_TxT = np.asarray(relative.row(jnp.arange(t)[:, None] - jnp.arange(t)[None, :]))
    key_table, query_table = (
        None if x is None else np.asarray(x, np.float64) for x in (relative.pos_key_RxNxH, relative.pos_query_RxNxH)
    )
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape)
    for b, length in enumerate(case.kv_lengths):
        for i in range(length):
            keys = np.arange(length) if segments is None else np.flatnonzero(segments[b] == segments[b, i])
            for n in range(case.num_heads):
                scores = k[b, keys, n] @ q[b, i, n]
                if key_table is not None:
                    scores = scores + key_table[rows_TxT[i, keys], n] @ q[b, i, n]
                if query_table is not None:
                    scores = scores + (query_table[rows_TxT[i, keys], n] * k[b, keys, n]).sum(-1)
                weights = np.exp((scores - scores.max()) * case.head_dim**-0.5)
                out[b, i, n] = weights / weights.sum() @ v[b, keys, n]
    return out


@pytest.mark.parametrize("variant,terms,packed", list(relative_params()))
def test_backend_with_relative_positions_matches_float64_reference(variant, terms, packed):
    from docbeam.attention.relative import random_relative

    name, raw_options = variant
    backend = attention.get(name)
    options = backend.parse_options(raw_options)
    case = RELATIVE_CASE
    asked = relative_case(packed)
    support = backend.refusal(asked) or backend.supports(asked, options)
    if not support.ok:
        pytest.skip(f"{name} {raw_options} refuses relative positions: {support.reason}")
    (q, k, v), kv_lengths_B, _ = make_inputs(case)  # garbage in padded positions
    relative = random_relative(case.num_heads, case.head_dim, case.seq_len, seed=3, terms=terms)
    segments = RELATIVE_SEGMENTS if packed else None
    features = {"relative_positions": relative} | ({"segment_ids_BxT": jnp.asarray(segments)} if packed else {})
    fn = backend.bind(options)

    got = np.asarray(
        jax.jit(lambda q, k, v: fn(q, k, v, kv_lengths_B=kv_lengths_B, scale=case.head_dim**-0.5, **features))(q, k, v)
    )

    want = relative_reference(q, k, v, relative, case, segments)  # valid keys only: the garbage is unseen
    assert np.isfinite(got).all(), "non-finite output (padded or fully padded rows included)"
    for row, length in enumerate(case.kv_lengths):
        error = float(np.abs(got[row, :length] - want[row, :length]).max(initial=0.0))
        assert error <= TOLERANCE[case.dtype], f"row {row} (length {length}): max abs error {error:.2e}"


RELATIVE_CASES = {"unpacked": relative_case(False), "packed": relative_case(True)}


@pytest.mark.parametrize("variant", relative_variants(), ids=variant_id)
def test_every_backend_declaring_relative_positions_runs_them_on_the_cpu(variant):
    assert_runs_a_declared_case(*variant, RELATIVE_CASES)


@pytest.mark.usefixtures("tests_package_importable")
def test_a_backend_that_refuses_the_relative_cases_it_declares_fails_the_check():
    refusing = "tests.fixtures_bad_backends:attend_declares_everything_refuses_everything"
    with pytest.raises(AssertionError, match=r"refuses every one on cpu.*never compare it: unpacked: not built"):
        assert_runs_a_declared_case(refusing, {}, RELATIVE_CASES)
    assert_runs_a_declared_case("chunked", {}, RELATIVE_CASES)  # the same check passes a backend that runs them
    assert_runs_a_declared_case("native", {}, RELATIVE_CASES)  # and one that declares no relative positions


def test_the_relative_terms_move_the_reference():
    """Each term, and the row function, changes the reference: the test above cannot pass with a term dropped."""
    import dataclasses as dc

    from docbeam.attention.relative import random_relative

    (q, k, v), _, plain = make_inputs(RELATIVE_CASE)
    both = random_relative(RELATIVE_CASE.num_heads, RELATIVE_CASE.head_dim, RELATIVE_CASE.seq_len, seed=3)
    want = relative_reference(q, k, v, both, RELATIVE_CASE)
    for changed in (
        dc.replace(both, pos_key_RxNxH=None),
        dc.replace(both, pos_query_RxNxH=None),
        dc.replace(both, row=lambda offset: both.row(-offset)),
    ):
        assert np.abs(relative_reference(q, k, v, changed, RELATIVE_CASE) - want)[:2, :41].max() > 0.1
    assert np.abs(want - np.asarray(plain))[:2, :41].max() > 0.1
