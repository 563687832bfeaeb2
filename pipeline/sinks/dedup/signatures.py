"""What each deduplication method compares, as small pure functions: the exact key (the text after Unicode NFC and
whitespace collapse), MinHash signatures of word n-grams and their LSH band keys (near), and the estimated Jaccard
similarity that verifies a candidate pair.

The hashes are stable across processes, machines and Python versions (never Python's ``hash``): a signature stored
with an output (``dedup_index/``) is compared with ones computed by a later run on other workers. Hashing is
vectorised with NumPy and done in pieces of n-grams (``shingle_piece``), so a huge document costs time in proportion
to its length and a bounded amount of memory (``PIECE_BYTES``, 8 MB, whatever the permutations)."""

from __future__ import annotations

import hashlib
import re
import unicodedata
import zlib

import numpy as np

SEED = 0x5EED_DB  # the permutations' seed: part of what a stored signature means (dedup_index/ records it)
PIECE_BYTES = 8 << 20  # a piece of n-grams × permutations, hashed at once
_WORD = re.compile(r"\w+", re.UNICODE)
_SPACE = re.compile(r"\s+", re.UNICODE)


def normalized(text: str) -> str:
    """The text as the exact method compares it: NFC, every run of whitespace one space, none at either end."""
    return _SPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def exact_key(text: str) -> str:
    """Identical for texts that differ only in Unicode composition and whitespace."""
    return hashlib.sha256(normalized(text).encode("utf-8")).hexdigest()[:32]


def words(text: str) -> list[str]:
    """The words the near method's n-grams are made of: NFKC, lower case, runs of letters and digits (punctuation
    and spacing do not make a document new, as in datatrove's and FineWeb's MinHash)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def shingle_hashes(text: str, ngram: int) -> np.ndarray:
    """The distinct 32-bit hashes of the text's word ``ngram``-grams; a text of fewer words is one shingle of all
    of them, and a text with no word at all one shingle of its normalized characters (never an empty set: every
    document gets a signature)."""
    tokens = words(text)
    if not tokens:
        tokens = [normalized(text)]
    word_hash = np.fromiter((zlib.crc32(w.encode("utf-8")) for w in tokens), np.uint64, len(tokens))
    n = min(ngram, len(tokens))
    # A polynomial of the n words' hashes (wrapping in 64 bits), then folded to 32 bits.
    combined = np.zeros(len(tokens) - n + 1, np.uint64)
    for k in range(n):
        combined = combined * np.uint64(1_000_003) + word_hash[k : len(tokens) - n + 1 + k]
    return np.unique((combined ^ (combined >> np.uint64(32))) & np.uint64(0xFFFF_FFFF))


def permutations(num_perm: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """The ``num_perm`` hash functions ``h(x) = ((a·x + b) mod 2^64) >> 32`` (multiply-shift), a odd."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, num_perm, dtype=np.uint64) | np.uint64(1)
    b = rng.integers(0, 2**63, num_perm, dtype=np.uint64)
    return a, b


def signature(text: str, ngram: int, num_perm: int, seed: int = SEED) -> np.ndarray:
    """The MinHash signature: for each permutation, the least hash of the text's shingles (uint32)."""
    a, b = permutations(num_perm, seed)
    shingles = shingle_hashes(text, ngram)
    least = np.full(num_perm, np.uint64(0xFFFF_FFFF))
    step = shingle_piece(num_perm)
    with np.errstate(over="ignore"):
        for start in range(0, len(shingles), step):
            piece = shingles[start : start + step, None]
            least = np.minimum(least, ((piece * a + b) >> np.uint64(32)).min(axis=0))
    return least.astype(np.uint32)


def shingle_piece(num_perm: int) -> int:
    """How many n-grams are hashed at once: PIECE_BYTES of uint64 whatever the permutations."""
    return max(1, PIECE_BYTES // (8 * num_perm))


def band_keys(sig: np.ndarray, bands: int, rows: int) -> list[str]:
    """One key per band: two documents sharing any key are a candidate pair. The band's index is in its key, so
    equal values in different bands never meet."""
    return [
        f"{b}:{hashlib.blake2b(sig[b * rows : (b + 1) * rows].tobytes(), digest_size=12).hexdigest()}"
        for b in range(bands)
    ]


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The share of permutations whose least hashes agree: an unbiased estimate of the n-gram sets' Jaccard."""
    return float(np.mean(np.asarray(a) == np.asarray(b)))


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    """The chance two documents of this similarity share a band: 1 − (1 − s^rows)^bands (the S-curve)."""
    return 1.0 - (1.0 - jaccard**rows) ** bands
