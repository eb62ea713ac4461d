"""The zip archive ``torch.save`` writes, checked the way the zip format allows before any tensor byte is trusted.

Shared by ``.bin`` checkpoints (``torch_pickle``) and the ``.distcp`` files of a sharded training checkpoint
(``dcp``), which hold the same archives.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from typing import BinaryIO, Mapping

from ..errors import CorruptCheckpointError, broken_rule

__all__ = ["ZipMember", "Archive", "read_archive", "byte_order", "member_error", "RESAVE"]

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # signature, version, flags, method, time, date, crc, sizes, name/extra lengths
_LOCAL_SIGNATURE = 0x04034B50
_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
_HAS_DESCRIPTOR = 0x08  # general purpose flag bit 3: crc and sizes follow the data (torch.save sets it)
_UTF8_NAMES = 0x800
_ZIP64_SIZE = 0xFFFFFFFF
RESAVE = "The file is corrupt: download or copy it again, or re-save it with torch.save."


@dataclass(frozen=True)
class ZipMember:
    """One member of a ``torch.save`` archive, where its central directory, local header and data descriptor agree."""

    name: str
    """Its name inside the archive's top folder (``data/0``, ``data.pkl``, ``byteorder``)."""
    data_offset: int
    """Absolute byte offset of its first data byte in the file (after the local header)."""
    size: int
    """Its bytes (stored uncompressed)."""


@dataclass(frozen=True)
class Archive:
    """A ``torch.save`` zip archive's members, checked against each other (no tensor byte read)."""

    members: Mapping[str, ZipMember]
    """By name inside the archive's top folder."""
    directory: tuple[int, int]
    """``[start, end)``: the central directory through the end of the file (what changes when the file is rewritten:
    it holds every member's CRC and size)."""
    bytes_read: int


def member_error(name: str, member: str, rule: str, expected: str, found: str) -> CorruptCheckpointError:
    return broken_rule(name, f"zip member {member!r}", rule, expected, found, fix=RESAVE)


def read_archive(f: BinaryIO, *, name: str) -> Archive:
    """The members of the zip archive ``f`` (a seekable binary file), checked the way the zip format allows:

    - the central directory parses (``zipfile``), every member name once;
    - ``local header``: at each member's offset a local file header naming the same member;
    - ``stored``: every member uncompressed, as ``torch.save`` writes them (its bytes are read in place);
    - ``member sizes``: the sizes (and CRC) the central directory gives equal the local header's, or the data
      descriptor's that ``torch.save`` writes right after the data;
    - ``no overlap``: members lie one after the other, before the central directory.

    Raises:
        CorruptCheckpointError: naming the member, the rule, what was expected and what was found.
    """
    try:
        archive = zipfile.ZipFile(f)
        infos = archive.infolist()
        directory_start = archive.start_dir
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError, struct.error) as e:
        raise CorruptCheckpointError(f"{name}: its zip directory is unreadable ({type(e).__name__}: {e}). {RESAVE}") from e
    size = f.seek(0, io.SEEK_END)
    read = size - directory_start
    members: dict[str, ZipMember] = {}
    spans: list[tuple[int, int, str]] = []
    for info in infos:
        member = info.filename.partition("/")[2]
        if member in members:
            raise member_error(name, info.filename, "unique names", "each member once", "it twice in the central directory")
        f.seek(info.header_offset)
        head = f.read(_LOCAL_HEADER.size)
        read += len(head)
        if len(head) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(head)[0] != _LOCAL_SIGNATURE:
            raise member_error(
                name, info.filename, "local header", f"a local file header at byte {info.header_offset} (the central directory's)",
                f"{head[:4]!r}",
            )
        _, _, flags, method, _, _, crc, compressed, uncompressed, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        local_name = f.read(name_len)
        read += name_len
        if local_name != info.orig_filename.encode("utf-8" if info.flag_bits & _UTF8_NAMES else "cp437"):
            raise member_error(name, info.filename, "local header", "the same name in its local header", repr(local_name[:100]))
        if method != zipfile.ZIP_STORED or info.compress_type != zipfile.ZIP_STORED:
            raise member_error(name, info.filename, "stored", "uncompressed (method 0)", f"method {info.compress_type}/{method}")
        if info.compress_size != info.file_size:
            raise member_error(
                name, info.filename, "member sizes", "equal stored and original sizes for an uncompressed member",
                f"{info.compress_size} and {info.file_size} bytes in the central directory",
            )
        data_offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        end = data_offset + info.file_size
        if flags & _HAS_DESCRIPTOR:
            f.seek(end)
            tail = f.read(24)
            read += len(tail)
            described = _descriptor(tail, info.CRC, info.file_size)
            if described is None:
                raise member_error(
                    name, info.filename, "member sizes",
                    f"a data descriptor at byte {end} saying crc {info.CRC:#010x} and {info.file_size} bytes (the central directory's)",
                    f"{tail[:16].hex()}: the central directory disagrees with the member's own sizes",
                )
            end += described
        elif (compressed, uncompressed, crc) != (info.compress_size, info.file_size, info.CRC) and _ZIP64_SIZE not in (compressed, uncompressed):
            raise member_error(
                name, info.filename, "member sizes", f"{info.file_size} bytes, crc {info.CRC:#010x} (the central directory's)",
                f"{uncompressed} bytes, crc {crc:#010x} in its local header",
            )
        members[member] = ZipMember(member, data_offset, info.file_size)
        spans.append((info.header_offset, end, info.filename))
    _check_no_overlap(name, spans, directory_start)
    return Archive(members, (directory_start, size), read)


def _check_no_overlap(name: str, spans: list[tuple[int, int, str]], directory_start: int) -> None:
    """The ``no overlap`` rule: members (``(start, end, member)`` spans) one after the other, before the directory."""
    spans = sorted(spans)
    for (_, prev_end, prev), (start, end, this) in zip(spans, spans[1:]):
        if start < prev_end:
            raise member_error(name, this, "no overlap", f"to start at or after byte {prev_end}, where {prev!r} ends", f"byte {start}")
    if spans and spans[-1][1] > directory_start:
        raise member_error(
            name, spans[-1][2], "no overlap", f"to end before the central directory at byte {directory_start}", f"byte {spans[-1][1]}"
        )


def _descriptor(tail: bytes, crc: int, size: int) -> int | None:
    """Bytes of the data descriptor at the start of ``tail`` if it says ``crc`` and ``size`` (32- or 64-bit sizes,
    with or without its signature, as writers vary), else None."""
    skip = 4 if tail[:4] == _DESCRIPTOR_SIGNATURE else 0
    for fmt in ("<III", "<IQQ"):
        width = struct.calcsize(fmt)
        if len(tail) >= skip + width and struct.unpack_from(fmt, tail, skip) == (crc, size, size):
            return skip + width
    return None


def byte_order(f: BinaryIO, archive: Archive) -> str:
    """The byte order the archive's values are stored in (its ``byteorder`` member)."""
    member = archive.members.get("byteorder")
    if member is None:
        return "little"  # torch's default for archives written before the record existed
    f.seek(member.data_offset)
    return f.read(member.size).decode("ascii", "replace")
