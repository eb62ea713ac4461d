"""Sharded training checkpoints (torch.distributed.checkpoint): read their layout, read each rank's part.

Two on-disk formats, both written by DCP:

- ``dcp.save(model.state_dict(), checkpoint_id=dir)``: ``.metadata`` (DCP's pickled ``Metadata``) plus
  ``__<rank>_<n>.distcp`` files. Each stored chunk is one ``torch.save`` zip archive at ``_StorageInfo.offset``;
  the tensor's bytes are one uncompressed record inside it.
- transformers' ``save_pretrained(..., distributed_checkpoint=True)`` (and ``lowmem_hf.save_pretrained``'s):
  ``shard-<r>-model-<i>-of-<n>.safetensors`` written by DCP's ``HuggingFaceStorageWriter``; each file holds
  one rank's local chunks, their global offsets in the ``DCP_SHARDING_INFO`` header metadata.

What is DCP's: the metadata (``FileSystemReader.read_metadata``, ``HuggingFaceStorageReader.read_metadata``:
global shapes, dtypes, every chunk's offsets and sizes, which file and byte range holds it). What is ours:
reading only the part of a chunk that overlaps this rank's slice. DCP's ``FileSystemReader.read_data``
``torch.load``s every stored chunk whole before narrowing it, so every TP rank reads (and holds) whole
chunks; the safetensors reader maps whole files. Here each rank reads only the byte runs of the overlap
from its byte source (``LocalFiles``: ``preadv``; an object store's ranges, or under a process group their
cooperative fetch, ``CooperativeChunks``), straight into its destination, through the same staging as the
Hub-format readers.

Also ours: checking the metadata before any tensor byte is read, with the rules DCP applies to what it saves
(``check_chunks``: every chunk a box inside its tensor, no two sharing an element), every byte range inside its
file and no two overlapping, and every element this rank reads stored (``check_covered``); each ``.distcp`` item is
checked as a ``.bin`` archive is (``zip_archive.read_archive``), and ``shard-*`` files as any safetensors file.

The package: ``layout.py`` reads and checks the metadata into a ``DcpLayout``; ``coverage.py`` checks, before
any byte is read, that what a load reads is stored and that a resumed model lacks nothing; ``reader.py`` holds
the reader and its jobs. Callers use the names below, as ``formats.dcp.<name>``.
"""

from __future__ import annotations

from .coverage import check_complete, check_covered
from .layout import (
    DCP_METADATA, DISTCP_SUFFIX, HF_SHARD_PATTERN, DcpLayout, StoredChunk, check_chunks, is_dcp_dir, read_layout,
)
from .reader import CooperativeChunks, DcpReader, open_reader, staging_bytes

__all__ = [
    "StoredChunk",
    "DcpLayout",
    "is_dcp_dir",
    "read_layout",
    "check_chunks",
    "check_covered",
    "check_complete",
    "DcpReader",
    "CooperativeChunks",
    "open_reader",
    "staging_bytes",
    "DCP_METADATA",
    "DISTCP_SUFFIX",
    "HF_SHARD_PATTERN",
]
