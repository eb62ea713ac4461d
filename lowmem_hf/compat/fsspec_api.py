"""fsspec and s3fs names lowmem_hf's object-store source uses (checked against fsspec/s3fs 2026.9.0).

s3fs reads ranges through ``cat_file(path, start, end)``, which takes no request condition: a range read that must
fail when the object was replaced since planning (``If-Match`` on its ETag, or its ``VersionId``) calls s3fs's own
client coroutine, ``S3FileSystem._call_s3`` (which translates S3's errors into ``OSError`` subclasses and retries
as the rest of s3fs does), on s3fs's event loop.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_s3", "s3_get_range_into", "s3_get_range_streamed"]


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem (whose range reads can carry a condition)."""
    return hasattr(fs, "_call_s3") and hasattr(fs, "split_path")


def s3_get_range_into(fs: Any, path: str, start: int, view: memoryview, *, etag: str | None, version: str | None) -> int:
    """Read bytes ``[start, start + len(view))`` of ``path`` (``bucket/key``) into ``view`` as they arrive (no copy of
    the whole range in between), only if the object still has ``etag`` (``If-Match``) and, where given, from
    ``version``; the number of bytes read (fewer: the body ended early). s3fs's translated error otherwise (412 ->
    ``OSError(EINVAL)``)."""
    from fsspec.asyn import sync

    async def get() -> int:
        body, got = await _conditional_body(fs, path, start, len(view), etag=etag, version=version), 0
        try:
            while got < len(view):
                n = await body.readinto(view[got:])
                if n == 0:
                    break
                got += n
            return got
        finally:
            body.close()

    return sync(fs.loop, get)


def s3_get_range_streamed(
    fs: Any, path: str, start: int, nbytes: int, consume, *, piece_bytes: int, etag: str | None, version: str | None,
) -> int:
    """As ``s3_get_range_into``, but the body is handed over as it arrives: ``consume(piece, at)`` per full
    ``piece_bytes`` (a multiple of every itemsize; the last piece is the rest), ``at`` its place in the range,
    called on s3fs's event loop. One buffer of ``piece_bytes``, reused: a range of any size costs no more."""
    from fsspec.asyn import sync

    piece = memoryview(bytearray(min(piece_bytes, nbytes)))

    async def get() -> int:
        body, got, filled = await _conditional_body(fs, path, start, nbytes, etag=etag, version=version), 0, 0
        try:
            while got + filled < nbytes:
                n = await body.readinto(piece[filled : min(len(piece), nbytes - got)])
                if n == 0:
                    break
                filled += n
                if filled == len(piece) or got + filled == nbytes:
                    consume(piece[:filled], got)
                    got, filled = got + filled, 0
            return got
        finally:
            body.close()

    return sync(fs.loop, get)


async def _conditional_body(fs: Any, path: str, start: int, nbytes: int, *, etag: str | None, version: str | None):
    """The body of s3fs's GET of bytes ``[start, start + nbytes)``, with ``If-Match: etag`` and the ``VersionId``."""
    bucket, key, _ = fs.split_path(path)
    condition = {"IfMatch": etag} if etag else {}
    if version:
        condition["VersionId"] = version
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{start + nbytes - 1}", **condition)
    return response["Body"]
