"""The checkpoint's tokenizer: ``tokenizer.json`` run by the ``tokenizers`` library, and the digest of the
tokenizer files that names, in the reuse key, the tokens a text becomes."""

from __future__ import annotations

import hashlib
import os
import threading

from docbeam.models.families.encoder_config import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def tokenizer_digest(folder: str) -> str:
    """Of the tokenizer files as they are: what decides the tokens a text becomes."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.exists(path):
            digest.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return f"sha256:{digest.hexdigest()}"


class FastTokenizer:
    """The checkpoint's ``tokenizer.json`` run by the ``tokenizers`` library, behind the part of a transformers
    fast tokenizer's interface docbeam uses (the call with truncation, stride and overflowing windows, the
    special-token count and ids). transformers would run the same Rust tokenizer, but importing it imports
    torch: seconds at every start. tests/tokenize_test.py holds the two equal on the sample corpus."""

    is_fast = True

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(path)
        self._tokenizer.no_padding()  # tokenizer.json may carry the padding and truncation it was saved with
        self._tokenizer.no_truncation()
        self._lock = threading.Lock()  # truncation is set per call on the shared Rust tokenizer
        special = self._tokenizer.encode("", add_special_tokens=True).ids
        self.cls_token_id = special[0] if special else None
        self.sep_token_id = special[-1] if special else None

    def token_id(self, token: str) -> int | None:
        """The vocabulary's id of ``token`` (an added token's too), or None when it is not one token."""
        return self._tokenizer.token_to_id(token)

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return self._tokenizer.num_special_tokens_to_add(pair)

    def __call__(
        self,
        text: str | list[str],
        *,
        add_special_tokens: bool = True,
        max_length: int | None = None,
        truncation: bool = False,
        stride: int = 0,
        return_overflowing_tokens: bool = False,
        return_attention_mask: bool = False,
        return_token_type_ids: bool = False,
        return_offsets_mapping: bool = False,
    ) -> dict:
        """``input_ids`` (one list per text, or one list for one string); with ``return_overflowing_tokens``
        every window of a truncated text is a row and ``overflow_to_sample_mapping`` names its text; with
        ``return_offsets_mapping``, ``offset_mapping``: each token's (start, end) in its text, in characters
        (Python str indices), (0, 0) for a special token."""
        del return_attention_mask, return_token_type_ids  # docbeam never asks for them
        texts = [text] if isinstance(text, str) else list(text)
        with self._lock:
            if truncation and max_length is not None:
                self._tokenizer.enable_truncation(
                    max_length, stride=stride, strategy="longest_first", direction="right"
                )
            else:
                self._tokenizer.no_truncation()
            encodings = self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        rows, offsets, mapping = [], [], []
        for index, encoding in enumerate(encodings):
            pieces = [encoding, *encoding.overflowing] if return_overflowing_tokens else [encoding]
            rows += [piece.ids for piece in pieces]
            offsets += [piece.offsets for piece in pieces]
            mapping += [index] * len(pieces)
        if isinstance(text, str) and not return_overflowing_tokens:
            return {"input_ids": rows[0], **({"offset_mapping": offsets[0]} if return_offsets_mapping else {})}
        out = {"input_ids": rows}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets
        if return_overflowing_tokens:
            out["overflow_to_sample_mapping"] = mapping
        return out


def load_tokenizer(folder: str) -> FastTokenizer:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        raise CheckpointError(f"model.path: {folder} has no fast tokenizer (tokenizer.json)")
    try:
        return FastTokenizer(path)
    except Exception as e:  # noqa: BLE001  the tokenizers library raises its own Exception for any bad file
        raise CheckpointError(
            f"model.path: {path} cannot be read by the tokenizers library ({str(e)[:300]}); "
            "copy the checkpoint's own tokenizer.json (transformers: tokenizer.save_pretrained)"
        ) from None
