"""safetensors: an 8-byte little-endian header length, a JSON header, then every tensor's raw bytes.

What only this format knows: parsing and checking the header (``read_header``; ``read_header_by_ranges`` for a
file read by byte ranges, e.g. over HTTP), validated as strictly as the safetensors library validates it, and
leaving tensors as views of the file (``mmap=True``, ``check_mmap``). Reading a tensor or a slice of it by byte
ranges from any byte source is ``base.RangeReader`` (``SafetensorsReader``), which ``.bin`` archives share.

Reading: ``preadv`` of the slice's byte ranges (or HTTP ranges). Same dtype on CPU: straight into the
destination's memory, no staging at all. Otherwise: through a reused staging buffer of ``chunk_bytes`` per
worker thread (pinned when the destination is a CUDA device, two while copies overlap reads: ``staging.Staging``),
converted by ``copy_`` chunk by chunk.
(Converting straight from a mapping of the file saves that copy, but on the 2 GB fp32 -> bf16 load, page-cache
warm, it is not reliably faster: across runs it measured from 17% slower to 9% faster. Not used: a file truncated
while it is mapped kills the process with SIGBUS, where ``preadv`` raises the named error.) With ``mmap=True`` no tensor is read at all: each becomes a
copy-on-write view of its file, as in transformers (``check_mmap``).
"""

from __future__ import annotations

import json
import os
import struct
from functools import partial
from typing import Any, Callable

import torch

from ..errors import CorruptCheckpointError, broken_rule
from ..runs import element_runs
from ..sources import ByteSource
from ..types import Checkpoint, CheckpointFormat, LoadPlan, ShardSpec, TensorInfo
from .base import RangeReader, Reader, StreamStats

__all__ = [
    "DTYPES", "TAGS", "encode_header", "header_length", "parse_header", "read_header", "read_header_by_ranges", "SafetensorsReader", "open_reader",
    "staging_bytes", "check_mmap",
]

# The safetensors format's dtype tags (its spec, `safetensors/src/tensor.rs` `Dtype`).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
# The same table read the other way, for writing.
TAGS: dict[torch.dtype, str] = {dtype: tag for tag, dtype in DTYPES.items()}

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000
# Every dtype tag the safetensors library (0.8) accepts; those missing from ``DTYPES`` are valid files lowmem_hf
# cannot load (sub-byte and exotic 8-bit floats).
_FORMAT_DTYPES = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)
_USIZE_MAX = 2**64 - 1
_REFUSED = "The safetensors library refuses this file too: it is corrupt or was not written by safetensors; download or copy it again."


def read_header(path: str) -> tuple[dict[str, TensorInfo], int]:
    """Parse and validate a local safetensors header against the file (``parse_header`` says what is checked).

    Written by hand because neither safetensors nor huggingface_hub exposes a *local* file's byte
    offsets (safetensors hides them behind ``get_slice``; huggingface_hub parses only remote headers),
    and streaming needs them to ``pread`` straight into the destination.

    Returns:
        ``({key: TensorInfo}, bytes_read)``.

    Raises:
        CorruptCheckpointError: the file breaks a rule of the format (named in the message).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:

        def fetch(start: int, stop: int) -> bytes:
            f.seek(start)
            return f.read(stop - start)

        return read_header_by_ranges(fetch, size=size, name=path)


def read_header_by_ranges(
    fetch: Callable[[int, int], bytes], *, size: int, name: str, first_bytes: int = 8
) -> tuple[dict[str, TensorInfo], int]:
    """Parse the header of a ``size``-byte safetensors file whose bytes ``[start, stop)`` ``fetch`` returns: first
    ``first_bytes`` (the length prefix, and the header too where the caller can estimate its size: one request
    instead of two on a remote file), then whatever of the header is still missing. ``name`` goes into
    ``TensorInfo.file`` and errors. A remote file is validated as a local one: ``size`` is the size the Hub reports.

    Returns:
        ``({key: TensorInfo}, bytes_read)``; ``bytes_read`` counts an over-estimate's tensor bytes too.

    Raises:
        CorruptCheckpointError: the file breaks a rule of the format (named in the message).
    """
    first = fetch(0, min(size, max(8, first_bytes)))
    header_len = header_length(first[:8], size, name)
    raw = first[8 : 8 + header_len]
    read = len(first)
    if len(raw) < header_len:
        rest = fetch(read, 8 + header_len)
        raw, read = raw + rest, read + len(rest)
    return parse_header(raw, header_len=header_len, file_size=size, name=name), read


def encode_header(items: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """A safetensors header (8-byte length + JSON padded to 8 bytes) for tensors stored in ``items`` order.

    Computed from names, dtypes and shapes alone, so a writer can put the header first and then each tensor's bytes
    at their offsets, one tensor at a time. The JSON is padded with spaces to a multiple of 8 bytes, as the
    safetensors library pads it, so the data section starts 8-byte aligned.
    """
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dt, shape in items:
        nbytes = dt.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": TAGS[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def header_length(prefix: bytes, size: int, name: str) -> int:
    """The header length the first 8 bytes (``prefix``) of a ``size``-byte file claim, checked against the file."""
    if len(prefix) < 8:
        raise CorruptCheckpointError(
            f"{name} is {size} bytes, too short for a safetensors file (an 8-byte header length comes first). "
            "The file is truncated: download or copy it again."
        )
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
        limit = f"at most {_MAX_HEADER_BYTES} bytes (the format's limit)" if header_len > _MAX_HEADER_BYTES else f"at most {size - 8}"
        raise CorruptCheckpointError(
            f"{name}: the header claims {header_len} bytes but the file has {size - 8} after the length prefix "
            f"(rule 'header length': expected {limit}). The file is truncated or not a safetensors file: download or copy it again."
        )
    return header_len


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, which a JSON \uXXXX escape can spell
        return False
    return True


def _unique_pairs(pairs: list[tuple[str, Any]], *, name: str) -> dict[str, Any]:
    """``json.loads`` hook: a JSON object whose keys are UTF-8 text (a ``\\ud800`` escape is not, and safetensors
    refuses it) and unique (plain JSON keeps the last of two, silently). ``name``: the file, for the error."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if not _is_utf8(key):
            raise broken_rule(
                name, f"key {key!r}", "header JSON", "UTF-8 text", "a lone surrogate escape, which is not UTF-8",
                rulebook="safetensors", fix=_REFUSED, key=key,
            )
        if key in out:
            raise broken_rule(
                name, f"key {key!r}", "unique keys", "each key once", "it twice (a JSON reader keeps the last one silently)",
                rulebook="safetensors", fix="The file is corrupt: download or copy it again.", key=key,
            )
        out[key] = value
    return out


def _no_constant(token: str) -> None:
    """``json.loads`` hook: NaN and Infinity are not JSON (Python's reader accepts them, serde_json does not)."""
    raise ValueError(f"{token} is not a JSON value")


def _plural(n: int, unit: str) -> str:
    return f"{n} {unit}" + ("" if n == 1 else "s")


def _is_usize(x: Any) -> bool:
    return type(x) is int and 0 <= x <= _USIZE_MAX


def parse_header(raw: bytes, *, header_len: int, file_size: int, name: str) -> dict[str, TensorInfo]:
    """Tensor infos from a safetensors header's bytes, validated as strictly as the safetensors library validates
    them; ``name`` goes into ``TensorInfo.file`` and errors.

    The rules (each error names the file, the key, the rule, what was expected and what was found):

    - ``header JSON``: UTF-8, one JSON object, only whitespace around it (writers pad it with spaces to align the
      data); ``unique keys``: no key twice, at any level (plain JSON would keep the last one silently);
    - ``__metadata__``: absent, null or an object of strings;
    - ``entry``: every other key is a tensor: ``dtype`` one of the format's tags, ``shape`` a list of
      non-negative integers, ``data_offsets`` two non-negative integers ``[begin, end)``;
    - ``byte size``: ``end - begin`` is the shape's element count times the dtype's size;
    - ``contiguous offsets``: sorted by offsets, the tensors start at 0 and each begins where the previous ends
      (no gap, no overlap: two tensors never share bytes);
    - ``data section covered``: the last one ends exactly at the end of the file (file size = 8 + header
      length + data): a length prefix one byte short, or bytes appended or cut, are caught here.

    Raises:
        CorruptCheckpointError: naming the rule broken.
    """
    invalid = partial(broken_rule, name, rulebook="safetensors", fix=_REFUSED)

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid("the header", "header JSON", "UTF-8 text", f"byte {raw[e.start]:#04x} at header byte {e.start}") from e
    try:
        header = json.loads(text, object_pairs_hook=partial(_unique_pairs, name=name), parse_constant=_no_constant)
    except ValueError as e:
        raise invalid("the header", "header JSON", "one JSON object padded with spaces", f"not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise invalid("the header", "header JSON", "one JSON object", f"a JSON {type(header).__name__}")

    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise invalid("'__metadata__'", "__metadata__", "an object of strings", repr(metadata)[:200])

    data_start = 8 + header_len
    data_size = file_size - data_start
    infos: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        subject = f"tensor {key!r}"
        if not isinstance(entry, dict) or not all(f in entry for f in ("dtype", "shape", "data_offsets")):
            raise invalid(subject, "entry", "an object with dtype, shape and data_offsets", repr(entry)[:200], key=key)
        tag, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if tag not in _FORMAT_DTYPES:
            raise invalid(subject, "entry", f"dtype among {', '.join(_FORMAT_DTYPES)}", repr(tag), key=key)
        if not isinstance(shape, list) or not all(_is_usize(d) for d in shape):
            raise invalid(subject, "entry", "shape a list of non-negative integers", repr(shape), key=key)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_usize(x) for x in offsets):
            raise invalid(subject, "entry", "data_offsets two non-negative integers [begin, end)", repr(offsets), key=key)
        if tag not in DTYPES:
            raise CorruptCheckpointError(
                f"{name}: tensor {key!r} is stored as {tag}, a safetensors dtype lowmem_hf cannot load "
                f"(it loads {', '.join(DTYPES)}). Convert the checkpoint, or load it with transformers."
            )
        begin, end = offsets
        info = TensorInfo(key=key, file=name, dtype=DTYPES[tag], shape=tuple(shape), offset=data_start + begin)
        if end < begin or end - begin != info.nbytes:
            raise invalid(
                subject, "byte size", f"{info.nbytes} bytes ({tag} x {shape})", f"data_offsets {offsets} ({end - begin} bytes)", key=key,
            )
        infos[key] = info
        spans.append((begin, end, key))

    _check_offsets(invalid, sorted(spans), data_size=data_size, file_size=file_size, header_len=header_len)
    return infos


def _check_offsets(
    invalid: Callable[..., Exception], spans: list[tuple[int, int, str]], *, data_size: int, file_size: int, header_len: int
) -> None:
    """The ``contiguous offsets`` and ``data section covered`` rules over the tensors' sorted ``(begin, end, key)``."""
    expected_begin, previous = 0, None
    for begin, end, key in spans:
        if begin != expected_begin:
            after = f"where {previous!r} ends" if previous is not None else "the start of the data section"
            what = "a gap of" if begin > expected_begin else "an overlap of"
            raise invalid(
                f"tensor {key!r}", "contiguous offsets", f"data_offsets beginning at {expected_begin} ({after})",
                f"[{begin}, {end}): {what} {_plural(abs(begin - expected_begin), 'byte')}", key=key,
            )
        expected_begin, previous = end, key
    if expected_begin != data_size:
        found = f"{data_size} bytes (file size {file_size} - 8 - header length {header_len})"
        if previous is None:
            raise invalid("the data section", "data section covered", "no data (the header lists no tensor)", found)
        expected = f"{expected_begin} bytes of data, ending where the last tensor, {previous!r}, ends"
        if data_size < expected_begin:
            raise invalid("the data section", "data section covered", expected, found, fix="The file is truncated: download or copy it again.")
        raise invalid(
            "the data section", "data section covered", expected,
            f"{found}: {_plural(data_size - expected_begin, 'byte')} that no tensor covers (a wrong header length, or bytes appended)",
        )


class SafetensorsReader(RangeReader):
    """Reads safetensors tensors (or slices of them) from a byte source: local files, HTTP ranges, the exchange
    (``RangeReader``); with ``mmap=True``, leaves them as views of their local files instead."""

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, stats: StreamStats, source: ByteSource, *, mmap: bool = False):
        super().__init__(plan_counts, chunk_bytes, stats, source)
        self._mmap = mmap

    def view(self, info: TensorInfo, dtype: torch.dtype, shape: tuple[int, ...], shard: ShardSpec | None, device) -> torch.Tensor | None:
        """``mmap=True``: the tensor as a copy-on-write view of its file; None without ``mmap=True``.

        Possible for a local file, a CPU destination of the stored dtype, a slice that is one contiguous run
        and an offset aligned to the dtype; ``check_mmap`` refused any other request before the stream began.
        Each view is its own storage (``torch.frombuffer``), so tied-weight detection and ``save_pretrained``
        see separate tensors, as with transformers' own mmap loads.
        """
        if not self._mmap:
            return None
        runs = element_runs(info.shape, shard)
        if not runs:  # nothing stored for this rank (an empty tensor or an empty uneven slice)
            return torch.empty(shape, dtype=dtype, device=device)
        [(src, n)], itemsize = runs, info.dtype.itemsize  # one run: check_mmap refused strided slices
        self._stats.opened(info.file)
        mm = self._source.mapping(info.file, kept=True)
        t = torch.frombuffer(mm, dtype=info.dtype, count=n, offset=info.offset + src * itemsize)
        self._stats.mapped_bytes += n * itemsize
        return t.view(shape)


def open_reader(checkpoint: Checkpoint, plan: LoadPlan, source: ByteSource, *, chunk_bytes: int, weights_only: bool, mmap: bool, stats: StreamStats) -> Reader:
    """The reader of a safetensors checkpoint (``weights_only`` has no meaning here: there is no pickle)."""
    return SafetensorsReader(plan.reads_per_file(), chunk_bytes, stats, source, mmap=mmap)


def staging_bytes(plan: LoadPlan, checkpoint: Checkpoint, *, workers: int, per_worker: int, converted: bool) -> int:
    """Host bytes the reader holds beyond the destinations: a chunk per reader thread where a dtype changes;
    the same dtype lands in place."""
    return workers * per_worker if converted else 0


def check_mmap(plan: LoadPlan, *, checkpoint_format: str, local: bool, device: torch.device) -> None:
    """Raise ``ValueError`` unless every tensor ``plan`` reads can be a copy-on-write view of its file (``mmap=True``).

    A view needs a local safetensors file, a CPU destination, the stored dtype, a slice that is one contiguous run
    and an offset aligned to the dtype; where one tensor cannot be, the request cannot be kept as asked, so it is
    refused before any byte is read (copying those tensors instead would quietly give a different memory profile).
    """
    def refuse(what: str, fix: str) -> None:
        raise ValueError(f"mmap=True leaves every loaded tensor as a copy-on-write view of its checkpoint file, but {what}. {fix}")

    if torch.device(device).type != "cpu":
        refuse(f"device={device} is not host memory", "Load on cpu with mmap=True, or drop mmap=True to copy onto the device.")
    if checkpoint_format != CheckpointFormat.SAFETENSORS:
        refuse(f"the checkpoint is {checkpoint_format}, not safetensors", "Convert it to safetensors, or drop mmap=True.")
    if not local:
        refuse("fetch='ranges' reads the Hub files into memory, not into local files", "Pass fetch='files' (into the HF cache) or drop mmap=True.")

    def listed(reads: list, describe: Callable) -> str:
        more = f" and {len(reads) - 3} more" if len(reads) > 3 else ""
        return ", ".join(f"{r.target} ({describe(r)})" for r in reads[:3]) + more

    converted = [r for r in plan.reads if r.decision.dtype != r.source.dtype]
    if converted:
        names = listed(converted, lambda r: f"stored {r.source.dtype}, loaded {r.decision.dtype} by rule {r.decision.rule!r}")
        refuse(f"{len(converted)} tensor(s) change dtype: {names}", "Pass torch_dtype='auto' (or the stored dtype), or drop mmap=True.")
    strided = [r for r in plan.reads if len(element_runs(r.source.shape, r.shard)) > 1]
    if strided:
        names = listed(strided, lambda r: f"sliced along dim {r.shard.dim}" if r.shard.intervals is None else f"mesh slice {r.shard.intervals}")
        refuse(
            f"{len(strided)} tensor-parallel slice(s) are not one contiguous range of the file: {names}",
            "Drop mmap=True for this tensor-parallel load (only dim-0 slices are contiguous).",
        )
    misaligned = [r for r in plan.reads if r.source.offset is None or r.source.offset % r.source.dtype.itemsize]
    if misaligned:
        r = misaligned[0]
        refuse(
            f"{r.source.key} in {r.source.file} starts at byte {r.source.offset}, not a multiple of its {r.source.dtype.itemsize}-byte dtype",
            "Re-save the checkpoint with a current safetensors (it aligns every tensor), or drop mmap=True.",
        )
    groups = [c for s in plan.submodules for c in s.conversions]
    if groups:
        refuse(
            f"transformers merges checkpoint tensors into {len(groups)} new tensor(s) (first: {groups[0].first_target})",
            "Drop mmap=True for this model.",
        )

