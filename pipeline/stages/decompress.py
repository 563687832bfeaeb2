"""Decompression of a stored input file, as Beam decompresses it by suffix, but strict about a cut end.

Kept apart from parsing: what bytes a file holds (this module) changes with Beam's compression types;
what a line of those bytes means (pipeline/stages/parse.py) changes with the product's input formats.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from typing import BinaryIO, Callable

from apache_beam.io.filesystem import CompressionTypes


def _zstd_decompressor():
    import zstandard  # Beam's own dependency for .zst; imported only for such a file

    return zstandard.ZstdDecompressor(max_window_size=1 << 31).decompressobj()  # Beam's window limit


# Each compression Beam reads (apache_beam.io.filesystem.CompressionTypes), as Beam decompresses it: a new
# decompressor per stream, one (compressed bytes per read, whether ``decompress`` takes ``max_length``).
_DECOMPRESSORS = {
    CompressionTypes.GZIP: (lambda: zlib.decompressobj(16 + zlib.MAX_WBITS), 1 << 16, True),
    CompressionTypes.DEFLATE: (zlib.decompressobj, 1 << 16, True),
    CompressionTypes.BZIP2: (bz2.BZ2Decompressor, 1 << 16, True),
    CompressionTypes.LZMA: (lzma.LZMADecompressor, 1 << 16, True),
    # No max_length: small reads bound what one call can produce (a zstd block of 128 kB can be 4 bytes).
    CompressionTypes.ZSTD: (_zstd_decompressor, 1 << 12, False),
}


class DecompressedStream:
    """The decompressed bytes of a stored file, ``read1(n)`` at a time, raising ``EOFError`` where the stored
    bytes end inside a compressed stream (a truncated file).

    Not Beam's ``CompressedFile``: it treats running out of input mid-stream as the end of the file, so a
    truncated ``.bz2``, ``.zst``, ``.xz`` or ``.deflate`` file would read as if whole. Streams one after
    another (``cat a.gz b.gz``) are read as one, as Beam and gzip read them; zero bytes after a gzip
    stream are padding, as gzip treats them.
    """

    def __init__(self, raw: BinaryIO, compression: str):
        self._raw, self._gzip = raw, compression == CompressionTypes.GZIP
        self._new, self._chunk, self._bounded = _DECOMPRESSORS[compression]
        self._decompressor, self._input, self._empty = self._new(), b"", True

    def read1(self, size: int) -> bytes:
        while self._decompressor is not None:
            if self._decompressor.eof:
                self._decompressor = self._next_stream()
                continue
            data = self._decompress(size)
            if data:
                return data
            if not self._input:
                self._input = self._raw.read(self._chunk)
                if not self._input and not self._decompressor.eof:
                    if self._empty:
                        return b""  # an empty file holds nothing, as gzip reads it; not a cut stream
                    raise EOFError("the compressed stream ends before its end marker")
                self._empty = False
        return b""

    def _next_stream(self):
        """A decompressor for the stream after the one that just ended, or None at the end of the file."""
        following = self._decompressor.unused_data + self._input
        while True:
            if self._gzip:
                following = following.lstrip(b"\0")
            if following:
                self._input = following
                return self._new()
            following = self._raw.read(self._chunk)
            if not following:
                return None

    def _decompress(self, size: int) -> bytes:
        if self._decompressor.eof:
            return b""
        if not self._bounded:
            data, self._input = self._decompressor.decompress(self._input), b""
            return data
        data = self._decompressor.decompress(self._input, size)
        # zlib hands back what it did not take; bz2 and lzma keep it and take more only when they need input
        self._input = getattr(self._decompressor, "unconsumed_tail", b"")
        return data

    def read(self, size: int) -> bytes:
        parts, left = [], size
        while left > 0:
            part = self.read1(left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def __enter__(self) -> "DecompressedStream":
        return self

    def __exit__(self, *_) -> None:
        self._raw.close()


def open_decompressed(open_raw: Callable[[], BinaryIO], path: str) -> BinaryIO:
    """The file's bytes, decompressed by its suffix as Beam would (``CompressionTypes.detect_compression_type``)."""
    compression = CompressionTypes.detect_compression_type(path)
    if compression == CompressionTypes.UNCOMPRESSED:
        return open_raw()
    return DecompressedStream(open_raw(), compression)
