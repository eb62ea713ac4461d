"""Generated bad inputs and faults against a tiny Llama, each load in a process of its own (integrity issue, item 7).

Shared by the property suite (tests/test_integrity_properties.py, hypothesis draws the choices) and the one-command
outcomes table (benchmarks/fuzz_integrity.py, a seeded ``random.Random`` draws them): a generator takes a ``Pick``
and returns a ``Trial``, plain data naming an action of this module and its parameters. ``Runner.run(trial)``
executes the action in a child forked from a fork server that imported torch, transformers and lowmem_hf once, with a
time limit; the child damages a private copy of a pristine checkpoint (or injects a fault), loads or saves, and
classifies what happened:

- ``intact``: the load equals transformers' ``from_pretrained`` of the intact checkpoint with the same arguments, bit
  for bit (keys, dtypes, bytes); a save left the folder loading as the old or the new checkpoint, whole;
- ``named``: a ``LowMemError``, or an exception lowmem_hf raised itself (a ``raise`` statement in lowmem_hf: its
  argument checks, the wrapped config errors, save's ``OSError`` naming the file), or transformers' ``ImportError``
  naming a package an argument needs (passed through on purpose);
- ``raw``: any other exception (transformers', torch's, a ``KeyError`` from deep inside, ...);
- ``wrong``: a load that returned other tensors than the reference, or loaded where transformers refuses the same
  input (the result of a load transformers itself does not make);
- ``crash``: the child died of a signal; ``hang``: it outlived the time limit and was killed;
- ``lost``: a save (failed, killed or full disk) left a folder that loads as neither the old nor the new checkpoint.

``OK = ("intact", "named")`` is the property the suite asserts.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import multiprocessing
import os
import pickle
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

OUTCOMES = ("intact", "named", "raw", "wrong", "crash", "hang", "lost")
OK = ("intact", "named")
LOAD_SECONDS = 60.0
"""Time limit of one trial (a tiny Llama loads in well under a second; a save trial loads up to three times)."""


# ------------------------------------------------------------------------------------------------- choices
class Pick:
    """Where a generator's choices come from: a seeded ``random.Random`` or hypothesis' ``data.draw``."""

    def choice(self, options: Sequence[Any]) -> Any:
        raise NotImplementedError

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``."""
        raise NotImplementedError

    def flag(self) -> bool:
        return self.choice([False, True])


class RandomPick(Pick):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def choice(self, options):
        return options[self.rng.randrange(len(options))]

    def integer(self, low, high):
        return self.rng.randint(low, high)


class DrawPick(Pick):
    """Choices drawn from hypothesis' ``st.data()``, so a failing trial shrinks to the simplest choices."""

    def __init__(self, data):
        from hypothesis import strategies as st

        self.data, self.st = data, st

    def choice(self, options):
        return options[self.data.draw(self.st.integers(0, len(options) - 1))]

    def integer(self, low, high):
        return self.data.draw(self.st.integers(low, high))


@dataclass(frozen=True)
class Trial:
    """One generated case: which action of this module runs in the child, with which parameters (picklable)."""

    category: str
    action: str
    params: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in self.params.items())
        return f"{self.action}({shown})"


@dataclass(frozen=True)
class Outcome:
    kind: str
    """One of ``OUTCOMES``."""
    detail: str = ""
    """The exception (type and message, cut), the tensor that differs, the signal, ..."""


def _short(value, limit: int = 70) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------- workspace
LLAMA_FORMATS = ("safetensors", "sharded", "bin", "bin_legacy")
DCP_KINDS = ("distcp", "hf_sharded")


def build_workspace(root: str) -> dict[str, str]:
    """The pristine checkpoints every trial copies: the tiny Llama in each Hub format and both DCP kinds, plus a
    second Llama (other weights, same shapes) for saves. ``{name: folder}``; built once, cached under ``root``."""
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers

    from checkpoints import make_checkpoint

    folders = {fmt: make_checkpoint(root, "llama", fmt) for fmt in LLAMA_FORMATS}
    dcp_dir = os.path.join(root, "llama-distcp")
    hf_sharded = os.path.join(root, "llama-hf_sharded")
    float8 = os.path.join(root, "llama-float8")
    if not os.path.isdir(dcp_dir) or not os.path.isdir(hf_sharded) or not os.path.isdir(float8):
        import lowmem_hf

        model = transformers.AutoModelForCausalLM.from_pretrained(folders["safetensors"])
        tmp = dcp_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        dcp.save(model.state_dict(), checkpoint_id=tmp, no_dist=True)
        model.config.save_pretrained(tmp)
        os.rename(tmp, dcp_dir)
        tmp = hf_sharded + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        lowmem_hf.save_pretrained(model, tmp, distributed_checkpoint=True)
        os.rename(tmp, hf_sharded)
        # every floating weight stored as float8 (config.json says float32, as a quantizer-less fp8 export does)
        from safetensors.torch import load_file, save_file

        tmp = float8 + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folders["safetensors"], tmp)
        path = os.path.join(tmp, "model.safetensors")
        save_file({k: v.to(torch.float8_e4m3fn) for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
        os.rename(tmp, float8)
    folders.update(distcp=dcp_dir, hf_sharded=hf_sharded, float8=float8)
    return folders


# ------------------------------------------------------------------------------------------------- the child side
def _classify_error(error: BaseException) -> Outcome:
    """``named`` for a LowMemError or an exception a ``raise`` statement of lowmem_hf made; else ``raw``."""
    import lowmem_hf
    from lowmem_hf.errors import LowMemError

    text = f"{type(error).__module__}.{type(error).__name__}: {error}"
    text = text if len(text) < 600 else text[:600] + "..."
    if isinstance(error, LowMemError):
        return Outcome("named", text)
    if isinstance(error, ImportError) and not isinstance(error, ModuleNotFoundError):
        # transformers' own "X has been toggled on, but ... the package for X doesn't seem to be installed": lowmem_hf
        # lets it through on purpose (routing._load_config), it names the package
        return Outcome("named", text)
    package = os.path.dirname(os.path.abspath(lowmem_hf.__file__))
    frames = traceback.extract_tb(error.__traceback__)
    innermost = frames[-1] if frames else None
    if innermost is not None and os.path.abspath(innermost.filename).startswith(package + os.sep):
        if (innermost.line or "").lstrip().startswith("raise "):
            return Outcome("named", text)
    where = f" (at {innermost.filename}:{innermost.lineno})" if innermost else ""
    return Outcome("raw", text + where)


def _same_state(got: dict, expected: dict) -> str | None:
    """None when ``got`` equals ``expected`` bit for bit; else what differs."""
    import torch

    if list(got) != list(expected):
        missing, extra = set(expected) - set(got), set(got) - set(expected)
        return f"keys differ: missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}"
    for key, want in expected.items():
        have = got[key]
        if have.dtype != want.dtype or have.shape != want.shape:
            return f"{key}: {have.dtype}{list(have.shape)} != {want.dtype}{list(want.shape)}"
        if have.device.type != "cpu" or want.device.type != "cpu":
            return f"{key}: on {have.device}, expected on {want.device}"
        a, b = have.contiguous().view(-1), want.contiguous().view(-1)
        if a.numel() and not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return f"{key}: values differ"
    return None


def _state(model) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


class Reference(dict):
    """transformers' state dict, and the keys it initialized rather than loaded (random: not compared)."""

    missing: frozenset = frozenset()


def _transformers_load(path: str, kwargs: dict) -> Reference:
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    reference = Reference(_state(model))
    reference.missing = frozenset(info["missing_keys"])
    return reference


def _judge_load(load: Callable[[], Any], reference: Callable[[], dict]) -> Outcome:
    """Run ``load``; compare what it returns with ``reference()`` (transformers' model of the intact input)."""
    try:
        model = load()
    except Exception as e:  # noqa: BLE001 - classifying every exception is the point
        return _classify_error(e)
    got = _state(model)
    try:
        expected = reference()
    except Exception as e:  # noqa: BLE001
        return Outcome("wrong", f"loaded, but transformers refuses the same input: {type(e).__name__}: {_short(str(e), 300)}")
    # keys neither loader loaded are initialized at random: they must be the same keys, their values cannot match
    missing = frozenset(model.lowmem_report.missing_keys)
    theirs = getattr(expected, "missing", frozenset())
    if missing != theirs:
        return Outcome("wrong", f"initialized instead of loaded: {sorted(missing - theirs)[:3]}; transformers also: {sorted(theirs - missing)[:3]}")
    differs = _same_state({k: v for k, v in got.items() if k not in missing}, {k: v for k, v in expected.items() if k not in missing})
    return Outcome("wrong", differs) if differs else Outcome("intact")


def _lowmem_load(path: str, **kwargs):
    import lowmem_hf

    return lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, **kwargs)


def _copy(ws: dict, name: str, scratch: str) -> str:
    dst = os.path.join(scratch, name)
    shutil.copytree(ws[name], dst, symlinks=True)
    return dst


def _reference_weights(ws: dict) -> Callable[[], dict]:
    """transformers' load of the intact safetensors Llama: what every format of the same weights must give."""
    return lambda: _transformers_load(ws["safetensors"], {})


# ----------------------------------------------------------------- safetensors headers
def _split(path: str) -> tuple[int, bytes, bytes]:
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n], raw[8 + n :]


def _entries(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _padded(text: bytes, pad: bytes = b" ") -> bytes:
    return text + pad * (8 + -len(text) % 8)


def _rewrite_header(path: str, how: str, key_index: int, value: Any) -> None:
    n, raw_header, data = _split(path)
    header = json.loads(raw_header)
    keys = _entries(header)
    key = keys[key_index % len(keys)]
    other = keys[(key_index + 1) % len(keys)]
    prefix_delta = 0
    text: bytes | None = None
    if how == "length":
        prefix_delta = value
    elif how == "offsets":
        begin, end = header[key]["data_offsets"]
        header[key]["data_offsets"] = value(begin, end, len(data), header[other]["data_offsets"])
    elif how in ("dtype", "shape"):
        header[key][how] = value
    elif how == "drop-entry":
        del header[key]
    elif how == "duplicate-key":
        body = json.dumps(header)
        text = (body[:-1] + f", {json.dumps(key)}: {json.dumps(header[other] if value else header[key])}}}").encode()
    elif how == "metadata":
        header["__metadata__"] = value
    elif how == "header-text":
        text = value
    elif how == "padding":
        text = _padded(json.dumps(header).encode(), value)
    elif how == "trailing-bytes":
        data = data + b"\0" * value
    elif how == "cut-file":
        data = data[: len(data) * value // 100]
    else:
        raise ValueError(how)
    if text is None:
        text = _padded(json.dumps(header).encode())
    length = max(0, min(2**64 - 1, len(text) + prefix_delta))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length) + text + data)


_OFFSET_CHANGES = {
    "shift+1": lambda b, e, size, o: [b + 1, e + 1],
    "shift-1": lambda b, e, size, o: [b - 1, e - 1],
    "shift+4096": lambda b, e, size, o: [b + 4096, e + 4096],
    "begin+4": lambda b, e, size, o: [b + 4, e],
    "end-4": lambda b, e, size, o: [b, e - 4],
    "swapped": lambda b, e, size, o: [e, b],
    "other's": lambda b, e, size, o: list(o),
    "past-the-end": lambda b, e, size, o: [size, size + e - b],
    "negative": lambda b, e, size, o: [-4, e - b - 4],
    "huge": lambda b, e, size, o: [2**63, 2**63 + e - b],
    "floats": lambda b, e, size, o: [float(b), float(e)],
    "strings": lambda b, e, size, o: [str(b), str(e)],
    "three": lambda b, e, size, o: [b, e, e],
    "empty": lambda b, e, size, o: [b, b],
}
_DTYPES = ["F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "I64", "C64", "F33", "", "f32", 5, None, ["F32"]]
_SHAPES = [[], [0], [1], [-1, 64], [2**62, 2**62], ["64"], [1.5], None, "64", [64, 64, 64], [2**31, 2**33]]


def gen_safetensors_header(pick: Pick) -> Trial:
    fmt = pick.choice(["safetensors", "sharded"])
    how = pick.choice(["length", "offsets", "dtype", "shape", "drop-entry", "duplicate-key", "metadata",
                       "header-text", "padding", "trailing-bytes", "cut-file"])
    value: Any = None
    if how == "length":
        value = pick.choice([-9, -8, -1, 1, 7, 8, 4096, 2**32, 2**63, -(2**20)])
    elif how == "offsets":
        value = pick.choice(sorted(_OFFSET_CHANGES))
    elif how == "dtype":
        value = pick.choice(_DTYPES)
    elif how == "shape":
        value = pick.choice(_SHAPES)
    elif how == "duplicate-key":
        value = pick.flag()
    elif how == "metadata":
        value = pick.choice([1, [], "pt", {"format": 1}, {"format": None}, {"a": {"b": 1}}, None])
    elif how == "header-text":
        value = pick.choice([b"", b"{}", b"[]", b"null", b"1", b'"x"', b"\xff\xfe{}", b"{" + b" " * 7, b'{"a": 1}',
                             b'{"__metadata__": {}}', b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'])
    elif how == "padding":
        value = pick.choice([b"\0", b"\t", b"\n", b"x", b"\xff", b"}"])
    elif how == "trailing-bytes":
        value = pick.choice([1, 7, 8, 4096])
    elif how == "cut-file":
        value = pick.integer(0, 99)
    return Trial("safetensors header", "damage_safetensors", dict(
        fmt=fmt, shard=pick.integer(1, 3), how=how, key_index=pick.integer(0, 40), value=value))


def damage_safetensors(ws, scratch, *, fmt, shard, how, key_index, value):
    folder = _copy(ws, fmt, scratch)
    name = "model.safetensors" if fmt == "safetensors" else f"model-{shard:05d}-of-00003.safetensors"
    if how == "offsets":
        value = _OFFSET_CHANGES[value]
    _rewrite_header(os.path.join(folder, name), how, key_index, value)
    return _judge_load(lambda: _lowmem_load(folder), _reference_weights(ws))


# ----------------------------------------------------------------- index JSON
_INDEX_VALUES = [1, None, ["model-00001-of-00003.safetensors"], {"a": 1}, "", ".", "..", "../x.safetensors",
                 "/etc/passwd", "missing.safetensors", "OTHER-SHARD", "sub/../model-00001-of-00003.safetensors",
                 "./model-00001-of-00003.safetensors", "config.json", "model.safetensors.index.json", "\x00",
                 "model-00001-of-00003.safetensors\x00x"]


def gen_index(pick: Pick) -> Trial:
    fmt = pick.choice(["sharded", "bin"])
    how = pick.choice(["entry", "all-entries", "weight_map", "metadata", "drop-entry", "extra-entry", "file-bytes",
                       "symlink-out"])
    value: Any = None
    if how in ("entry", "all-entries", "extra-entry"):
        value = pick.choice(_INDEX_VALUES)
    elif how == "weight_map":
        value = pick.choice([{}, [], "x", None, 1, "MISSING"])
    elif how == "metadata":
        value = pick.choice([None, [], "x", {"total_size": "x"}, {"total_size": -1}, {"total_size": 1},
                             {"total_size": None}, "MISSING"])
    elif how == "file-bytes":
        value = pick.choice([b"", b"{", b"[]", b"null", b"\xff\xfe\x00{", b"\xef\xbb\xbf", "latin-1", "cut", b"{}"])
    return Trial("index", "damage_index", dict(fmt=fmt, how=how, key_index=pick.integer(0, 40), value=value))


def damage_index(ws, scratch, *, fmt, how, key_index, value):
    folder = _copy(ws, fmt, scratch)
    name = "model.safetensors.index.json" if fmt == "sharded" else "pytorch_model.bin.index.json"
    path = os.path.join(folder, name)
    raw = open(path, "rb").read()
    index = json.loads(raw)
    keys = sorted(index["weight_map"])
    key = keys[key_index % len(keys)]
    shards = sorted(set(index["weight_map"].values()))
    if fmt == "bin" and isinstance(value, str):
        value = value.replace("model-00001-of-00003.safetensors", shards[0])
    if value == "OTHER-SHARD":
        value = next(s for s in shards if s != index["weight_map"][key])
    out: bytes | None = None
    if how == "entry":
        index["weight_map"][key] = value
    elif how == "all-entries":
        index["weight_map"] = dict.fromkeys(index["weight_map"], value)
    elif how == "extra-entry":
        index["weight_map"]["model.extra.weight"] = value
    elif how == "drop-entry":
        del index["weight_map"][key]
    elif how in ("weight_map", "metadata"):
        if value == "MISSING":
            index.pop(how if how == "weight_map" else "metadata")
        else:
            index[how] = value
    elif how == "file-bytes":
        if value == "latin-1":
            index["weight_map"][key] = index["weight_map"][key]
            out = json.dumps(index, ensure_ascii=False).replace(key, key + "\u00e9", 1).encode("latin-1")
        elif value == "cut":
            out = raw[: len(raw) // 2]
        elif value == b"\xef\xbb\xbf":
            out = value + raw
        else:
            out = value
    elif how == "symlink-out":
        outside = os.path.join(scratch, "outside")
        os.makedirs(outside)
        shard = index["weight_map"][key]
        shutil.move(os.path.join(folder, shard), os.path.join(outside, shard))
        os.symlink(os.path.join(outside, shard), os.path.join(folder, shard))
    with open(path, "wb") as f:
        f.write(out if out is not None else json.dumps(index).encode())
    return _judge_load(lambda: _lowmem_load(folder), _reference_weights(ws))


# ----------------------------------------------------------------- DCP metadata
def gen_dcp(pick: Pick) -> Trial:
    kind = pick.choice(DCP_KINDS)
    if kind == "distcp":
        how = pick.choice(["chunk-offsets", "chunk-sizes", "storage-offset", "storage-length", "relative-path",
                           "dtype", "size", "drop-storage", "drop-key", "swap-storage", "metadata-bytes",
                           "cut-distcp", "no-distcp"])
    else:
        how = pick.choice(["info-key", "info-offsets", "info-offsets-type", "info-offsets-rank", "info-json",
                           "info-missing", "info-drop-key", "info-version", "shard-header-cut"])
    return Trial("dcp metadata", "damage_dcp", dict(kind=kind, how=how, key_index=pick.integer(0, 40),
                                                    n=pick.choice([-1, 1, 2, 7, 64, 4096, 10**6])))


def _swapped(state: dict, a: str, b: str) -> dict:
    state[a], state[b] = state[b], state[a]
    return state


def damage_dcp(ws, scratch, *, kind, how, key_index, n):
    import dataclasses

    import torch

    folder = _copy(ws, kind, scratch)
    if kind == "distcp":
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        meta_path = os.path.join(folder, ".metadata")
        metadata = pickle.loads(open(meta_path, "rb").read())
        keys = sorted(metadata.state_dict_metadata)
        key, other = keys[key_index % len(keys)], keys[(key_index + 1) % len(keys)]
        entry = metadata.state_dict_metadata[key]
        chunk = entry.chunks[0]
        index = MetadataIndex(key, chunk.offsets)
        storage = metadata.storage_data[index]
        raw: bytes | None = None
        if how in ("chunk-offsets", "chunk-sizes"):
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            (offsets if how == "chunk-offsets" else sizes)[-1] += n
            new = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            entry.chunks = [new]
            metadata.storage_data[MetadataIndex(key, new.offsets)] = metadata.storage_data.pop(index)
        elif how == "storage-offset":
            metadata.storage_data[index] = dataclasses.replace(storage, offset=storage.offset + n)
        elif how == "storage-length":
            metadata.storage_data[index] = dataclasses.replace(storage, length=storage.length + n)
        elif how == "relative-path":
            path = {-1: "/etc/passwd", 1: "../x.distcp", 2: "missing.distcp", 7: "", 64: ".metadata", 4096: ".",
                    10**6: "sub/../" + storage.relative_path}[n]
            metadata.storage_data[index] = dataclasses.replace(storage, relative_path=path)
        elif how == "dtype":
            dtype = {-1: torch.float16, 1: torch.int8, 2: torch.bfloat16, 7: torch.float64, 64: torch.bool,
                     4096: torch.float8_e4m3fn, 10**6: torch.int64}[n]
            entry.properties = dataclasses.replace(entry.properties, dtype=dtype)
        elif how == "size":
            size = list(entry.size)
            size[0] += n
            entry.size = torch.Size(size)
        elif how == "drop-storage":
            del metadata.storage_data[index]
        elif how == "drop-key":
            del metadata.state_dict_metadata[key]
        elif how == "swap-storage":
            other_index = MetadataIndex(other, metadata.state_dict_metadata[other].chunks[0].offsets)
            metadata.storage_data[index], metadata.storage_data[other_index] = (
                metadata.storage_data[other_index], metadata.storage_data[index])
            if entry.size == metadata.state_dict_metadata[other].size:
                # two tensors of one shape trading places is a valid checkpoint of other weights, not damage: the
                # reference trades them too
                reference = _reference_weights(ws)
                with open(meta_path, "wb") as f:
                    f.write(pickle.dumps(metadata))
                return _judge_load(lambda: _lowmem_load(folder), lambda: _swapped(reference(), key, other))
        elif how == "metadata-bytes":
            whole = open(meta_path, "rb").read()
            raw = {-1: b"", 1: whole[: len(whole) // 2], 2: b"garbage", 7: pickle.dumps({"a": 1}), 64: pickle.dumps(None),
                   4096: whole[:-1], 10**6: whole + b"\0"}[n]
        elif how == "cut-distcp":
            for name in os.listdir(folder):
                if name.endswith(".distcp"):
                    path = os.path.join(folder, name)
                    os.truncate(path, max(0, os.path.getsize(path) - abs(n)))
        elif how == "no-distcp":
            for name in os.listdir(folder):
                if name.endswith(".distcp"):
                    os.remove(os.path.join(folder, name))
        with open(meta_path, "wb") as f:
            f.write(raw if raw is not None else pickle.dumps(metadata))
    else:
        names = sorted(n_ for n_ in os.listdir(folder) if n_.startswith("shard-"))
        path = os.path.join(folder, names[key_index % len(names)])
        length, raw_header, data = _split(path)
        header = json.loads(raw_header)
        meta = header.get("__metadata__") or {}
        info_key = "DCP_VERSION" if how == "info-version" else "DCP_SHARDING_INFO" if "DCP_SHARDING_INFO" in meta else None
        if how == "shard-header-cut":
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", length) + raw_header + data[: len(data) // 2])
            return _judge_load(lambda: _lowmem_load(folder), _reference_weights(ws))
        if info_key is None:
            return Outcome("intact", "no sharding info to damage")
        text = meta[info_key]
        try:
            info = json.loads(text)
        except ValueError:
            info = None
        if isinstance(info, dict) and info:
            keys = sorted(info)
            k = keys[key_index % len(keys)]
            if how == "info-key":
                info["model.nonexistent.weight"] = info.pop(k)
            elif how == "info-drop-key":
                del info[k]
            elif how == "info-offsets":  # DCP_SHARDING_INFO: {key: {"saved_offsets": [...]}}
                info[k]["saved_offsets"][0] += n
            elif how == "info-offsets-type":
                info[k]["saved_offsets"] = [str(x) for x in info[k]["saved_offsets"]] if n > 0 else None
            elif how == "info-offsets-rank":
                info[k]["saved_offsets"] = info[k]["saved_offsets"] + [0] if n > 0 else info[k]["saved_offsets"][:-1]
            text = json.dumps(info)
        elif how == "info-version":
            text = {-1: "", 1: "x", 2: "2.0", 7: "-1"}.get(n, "1.0.0")
        if how == "info-json":
            text = text[: len(text) // 2]
        elif how == "info-missing":
            del meta[info_key]
            text = None
        if text is not None:
            meta[info_key] = text
        header["__metadata__"] = meta
        new = _padded(json.dumps(header).encode())
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(new)) + new + data)
    return _judge_load(lambda: _lowmem_load(folder), _reference_weights(ws))


# ----------------------------------------------------------------- config.json
_CONFIG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_scaling",
                  "rope_parameters", "rope_theta", "tie_word_embeddings", "dtype", "torch_dtype", "model_type",
                  "architectures", "hidden_act", "attention_bias", "transformers_weights", "pad_token_id",
                  "layer_types", "pretraining_tp", "mlp_bias"]
_CONFIG_VALUES = [0, -1, -64, 1, 3, 65, 10**12, 2.5, float("nan"), "abc", "nonsense", None, [], {}, True,
                  {"rope_type": "nonsense"}, {"rope_type": "linear"}, {"rope_type": "linear", "factor": -1.0},
                  {"rope_type": "yarn", "factor": "x"}, {"type": "dynamic", "factor": 0}, ["full_attention"],
                  "float8_e4m3fn", "int8", "bfloat16", "../outside.safetensors", "gpt2"]


# values aimed at one field (half of the draws), besides the ones any field may get
_FIELD_VALUES = {
    "rope_scaling": [{"rope_type": "nonsense"}, {"rope_type": "linear"}, {"rope_type": "yarn", "factor": "x"},
                     {"rope_type": "dynamic", "factor": 0.0}, {"rope_type": "llama3", "factor": 8.0}, {"type": "nonsense"}],
    "rope_parameters": [{"rope_type": "nonsense", "rope_theta": 10000.0}, {"rope_type": "default"}, {"rope_theta": -1.0},
                        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, {"rope_type": 5}],
    "num_key_value_heads": [0, -2, 3, 5, 8],
    "num_attention_heads": [0, 3, 5, 8, -4],
    "head_dim": [0, 8, 15, 17, -16],
    "hidden_act": ["nonsense", "gelu", "relu2", ""],
    "layer_types": [["full_attention"], ["sliding_attention", "full_attention"], ["nonsense", "nonsense"]],
    "dtype": ["float8_e4m3fn", "int8", "bfloat16", "nonsense", "float64", "complex64"],
}


def gen_config(pick: Pick) -> Trial:
    how = pick.choice(["field"] * 5 + ["delete-field", "file-bytes"])
    name = pick.choice(_CONFIG_FIELDS)
    values = _FIELD_VALUES.get(name, _CONFIG_VALUES) if pick.flag() else _CONFIG_VALUES
    return Trial("config", "damage_config", dict(
        how=how, field=name, value=pick.choice(values),
        raw=pick.choice([b"", b"{", b"[]", b"null", b"\xff\xfe{}", b'{"model_type": "llama"', b'{"model_type": 5}'])))


def damage_config(ws, scratch, *, how, field, value, raw):
    folder = _copy(ws, "safetensors", scratch)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    if how == "field":
        config[field] = value
    elif how == "delete-field":
        config.pop(field, None)
    with open(path, "wb") as f:
        f.write(raw if how == "file-bytes" else json.dumps(config).encode())
    # the weights are intact: transformers' load of the same folder is the reference
    return _judge_load(lambda: _lowmem_load(folder), lambda: _transformers_load(folder, {}))


# ----------------------------------------------------------------- from_pretrained arguments
_ARGUMENTS = {
    "dtype": ["auto", "float32", "bfloat16", "float16", "torch.float16", "bogus", 3, None, "T:bfloat16", "T:int8",
              "T:float8_e4m3fn", "T:float64", "T:complex64"],
    "torch_dtype": ["auto", "T:bfloat16", "float16", "int8"],
    "device": ["cpu", "D:cpu", "bogus", "meta", "cuda", "cuda:0", 0, -1, True, "cpu:0"],
    "device_map": ["cpu", {"": "cpu"}, "auto", "meta", {"": "bogus"}, {"model": "cpu"}, "sequential", 0],
    "key_mapping": [{"(": "x"}, {"^model\\.": "model."}, {"layers": "blocks"}, {"a": 1}, [("a", "b")],
                    {"^model\\.": ""}, {"": "x"}, {"mlp": "attn"}],
    "dtype_overrides": [{"*.weight": "T:bfloat16"}, {"*norm*": "T:float16"}, {"*": "int8"}, {"[": "T:float16"},
                        {"*": "bogus"}, [("*", "T:float16")], {"*": "T:float8_e4m3fn"}, {"lm_head*": "float64"}, "x"],
    "dtype_policy": ["declared", "loaded", "bogus", None],
    "config": ["FOLDER", "FILE", 5, "LlamaConfig", "GPT2Config", "LlamaConfig-vocab-200", "/nonexistent/x",
               "LlamaConfig-layers-1"],
    "ignore_mismatched_sizes": [True, "yes"],
    "chunk_bytes": [1, 0, -1, 7, "x"],
    "read_ahead_bytes": [0, -1, "x"],
    "mmap": [True, "yes"],
    "weights_only": [False, None],
    "use_safetensors": [True, False, "x"],
    "variant": ["v2", "", "../x", None],
    "subfolder": ["", "x", "..", "/"],
    "output_loading_info": [True],
    "low_cpu_mem_usage": [True, False],
    "fetch": ["ranges", "files", "bogus"],
    "checkpoint_format": ["dcp", "bogus", None],
    "revision": ["main", "abc"],
    "trust_remote_code": [True, False],
    "attn_implementation": ["eager", "sdpa", "bogus", "flash_attention_2", {"": "eager"}],
    "generation_config": ["x", 5],
    "local_files_only": [True],
    "verify_downloads": [False, "yes"],
}


def gen_arguments(pick: Pick) -> Trial:
    fmt = pick.choice(["safetensors", "sharded", "bin", "float8"])
    names = sorted(_ARGUMENTS)
    chosen = {}
    for _ in range(pick.integer(1, 3)):
        name = pick.choice(names)
        chosen[name] = pick.choice(_ARGUMENTS[name])
    return Trial("arguments", "load_with_arguments", dict(fmt=fmt, kwargs=chosen))


def _decode_argument(value, folder):
    import torch
    import transformers

    if isinstance(value, str) and value.startswith("T:"):
        return getattr(torch, value[2:])
    if isinstance(value, str) and value.startswith("D:"):
        return torch.device(value[2:])
    if value == "FOLDER":
        return folder
    if value == "FILE":
        return os.path.join(folder, "config.json")
    if isinstance(value, str) and value.startswith("LlamaConfig"):
        config = transformers.AutoConfig.from_pretrained(folder)
        if value.endswith("vocab-200"):
            config.vocab_size = 200
        if value.endswith("layers-1"):
            config.num_hidden_layers = 1
        return config
    if value == "GPT2Config":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96)
    if isinstance(value, dict):
        return {k: _decode_argument(v, folder) for k, v in value.items()}
    if isinstance(value, list):
        return [tuple(_decode_argument(x, folder) for x in item) if isinstance(item, tuple) else item for item in value]
    return value


# lowmem_hf's own arguments: transformers' reference load goes without them (and the overrides are applied to it)
_OWN_ARGUMENTS = ("dtype_overrides", "dtype_policy", "chunk_bytes", "read_ahead_bytes", "mmap", "device", "fetch",
                  "checkpoint_format", "verify_downloads")


def load_with_arguments(ws, scratch, *, fmt, kwargs):
    import torch

    folder = _copy(ws, fmt, scratch)
    ours = {k: _decode_argument(v, folder) for k, v in kwargs.items()}
    theirs = {k: copy.copy(v) for k, v in ours.items() if k not in _OWN_ARGUMENTS}
    if "device" in ours and "device_map" not in ours:
        theirs["device_map"] = ours["device"]
    theirs.pop("output_loading_info", None)
    for name in ("dtype", "torch_dtype"):  # lowmem_hf also reads 'torch.float16' (transformers: AttributeError)
        if isinstance(theirs.get(name), str) and theirs[name].startswith("torch.") and hasattr(torch, theirs[name][6:]):
            theirs[name] = getattr(torch, theirs[name][6:])

    def load():
        out = _lowmem_load(folder, **ours)
        return out[0] if isinstance(out, tuple) else out

    def reference():
        expected = _transformers_load(folder, theirs)
        overrides = ours.get("dtype_overrides") or {}
        pairs = list(overrides.items()) if isinstance(overrides, dict) else list(overrides)
        if ours.get("dtype_policy", "declared") == "declared":
            for key, tensor in expected.items():  # the first matching glob wins (the overrides are an ordered list)
                dtype = next((d for glob, d in pairs if fnmatch.fnmatchcase(key, glob)), None)
                if dtype is not None and tensor.is_floating_point():
                    expected[key] = tensor.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        if ours.get("dtype_policy") == "loaded":
            raise NotImplementedError("dtype_policy='loaded': no transformers reference")
        return expected

    outcome = _judge_load(load, reference)
    if outcome.kind == "wrong" and "no transformers reference" in outcome.detail:
        return Outcome("intact", "dtype_policy='loaded' loaded (no reference to compare with)")
    return outcome


# ----------------------------------------------------------------- truncation mid-load
def gen_truncation(pick: Pick) -> Trial:
    source = pick.choice(["local", "local", "hub-files", "hub-ranges"])
    if source == "local":
        fmt = pick.choice(["safetensors", "sharded", "bin", "bin_legacy", "distcp", "hf_sharded"])
    else:
        fmt = pick.choice(["safetensors", "sharded"] + (["bin"] if source == "hub-files" else []))
    return Trial("truncation", "truncate_mid_load", dict(
        fmt=fmt, source=source, event=pick.integer(1, 12), keep_percent=pick.integer(0, 99),
        file_index=pick.integer(0, 5)))


def _weight_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".bin", ".distcp")))


def truncate_mid_load(ws, scratch, *, fmt, source, event, keep_percent, file_index):
    # not with mmap=True: its parameters are views of the file, which must not change while the model lives (README)
    folder = _copy(ws, fmt, scratch)
    files = _weight_files(folder)
    target = files[file_index % len(files)]
    kwargs = dict(chunk_bytes=4096)
    if source == "local":
        return _judge_load(lambda: _with_local_cut(folder, target, event, keep_percent, kwargs), _reference_weights(ws))
    return _judge_load(lambda: _with_hub_cut(scratch, folder, target, event, keep_percent, source, kwargs), _reference_weights(ws))


def _with_local_cut(folder, target, event, keep_percent, kwargs):
    """Load ``folder``; at the ``event``-th read of any byte source call, ``target`` is truncated to ``keep_percent``."""
    from lowmem_hf.sources.local import LocalFiles

    path = os.path.join(folder, target)
    calls = [0]

    def cut():
        calls[0] += 1
        if calls[0] == event:
            os.truncate(path, os.path.getsize(path) * keep_percent // 100)

    originals = {name: getattr(LocalFiles, name) for name in ("read", "read_runs", "mapping")}

    def wrap(name):
        real = originals[name]

        def call(self, *args, **kw):
            if name == "mapping":
                result = real(self, *args, **kw)
                cut()
                return result
            cut()
            return real(self, *args, **kw)

        return call

    for name in originals:
        setattr(LocalFiles, name, wrap(name))
    try:
        return _lowmem_load(folder, **kwargs)
    finally:
        for name, real in originals.items():
            setattr(LocalFiles, name, real)


def _with_hub_cut(scratch, folder, target, event, keep_percent, source, kwargs):
    """Serve ``folder`` from a loopback Hub; after the ``event``-th GET of a weight file the server's copy of
    ``target`` is truncated (a new inode: responses already streaming finish with the old bytes)."""
    from hub_server import HF_DEFAULT_LFS_PATTERNS, HubServer, use_hub

    server = HubServer(os.path.join(scratch, "hub"), lfs_patterns=HF_DEFAULT_LFS_PATTERNS)
    repo = "org/llama"
    with server:
        server.add_repo(repo, folder)
        data = server.file_path(repo, target).read_bytes()
        gets = [0]

        def predicate(record):
            if record.method == "GET" and record.filename and record.filename.endswith((".safetensors", ".bin")):
                gets[0] += 1
            return gets[0] >= event

        server.replace_file(repo, target, data[: len(data) * keep_percent // 100], when=predicate)
        with use_hub(server, os.path.join(scratch, "hf_home")):
            return _lowmem_load(repo, fetch="files" if source == "hub-files" else "ranges", **kwargs)


# ----------------------------------------------------------------- Hub faults
def gen_hub_fault(pick: Pick) -> Trial:
    fetch = pick.choice(["files", "ranges"])
    return Trial("hub faults", "load_through_hub_fault", dict(
        fmt=pick.choice(["safetensors", "sharded"] + (["bin"] if fetch == "files" else [])), fetch=fetch,
        # a file changed under the same ETag is caught by fetch="files" (its sha256); ranged reads trust the ETag, the
        # Hub's content address (README, "Hub repos"), so that fault is drawn for files only
        fault=pick.choice(["corrupt", "cut-close", "cut-reset", "fail-503", "fail-500", "fail-404", "replace-same-size",
                           "lying-size"] + (["replace-keep-etag"] if fetch == "files" else [])),
        count=pick.choice([1, 2, 3, None]), after=pick.choice([0, 8, 100, 4096, 65536]), file_index=pick.integer(0, 5)))


def load_through_hub_fault(ws, scratch, *, fmt, fetch, fault, count, after, file_index):
    """A load from the loopback Hub while it corrupts bodies in transit, cuts or fails requests, changes a file under
    the load (keeping or changing its ETag) or lies about a size: the intact model, or a named error."""
    from hub_server import HF_DEFAULT_LFS_PATTERNS, HubServer, use_hub

    folder = _copy(ws, fmt, scratch)
    target = _weight_files(folder)[file_index % len(_weight_files(folder))]
    # weight files are LFS files, as on the Hub (.gitattributes): their ETag is their sha256
    server = HubServer(os.path.join(scratch, "hub"), lfs_patterns=HF_DEFAULT_LFS_PATTERNS)
    repo = "org/llama"
    data = bytearray(open(os.path.join(folder, target), "rb").read())
    data[len(data) // 2] ^= 0xFF  # replace-*: one byte of tensor data (or of the pickle) flipped, same size

    def load():
        with server:
            server.add_repo(repo, folder)
            pattern = "*.safetensors" if fmt != "bin" else "*.bin"
            if fault == "corrupt":
                server.corrupt_next(count, path=pattern)
            elif fault.startswith("cut-"):
                server.cut_next(after, count, path=pattern, mode=fault[4:])
            elif fault.startswith("fail-"):
                server.fail_next(int(fault[5:]), count, path=pattern)
            elif fault.startswith("replace-"):
                seen = [0]

                def predicate(record):
                    seen[0] += record.method == "GET" and bool(record.filename) and record.filename.endswith(pattern[1:])
                    return seen[0] >= (count or 1)

                server.replace_file(repo, target, bytes(data), keep_etag=fault == "replace-keep-etag", when=predicate)
            elif fault == "lying-size":
                server.override_size(repo, target, os.path.getsize(os.path.join(folder, target)) + (after or 1))
            with use_hub(server, os.path.join(scratch, "hf_home")):
                loaded.append(_lowmem_load(repo, fetch=fetch, chunk_bytes=4096))
                return loaded[-1]

    loaded = []
    outcome = _judge_load(load, _reference_weights(ws))
    if outcome.kind == "wrong" and fault.startswith("replace-") and loaded:
        # the server changed the file before the load planned with it: the new file, read consistently, is right too
        changed = os.path.join(scratch, "as-replaced")
        shutil.copytree(folder, changed)
        with open(os.path.join(changed, target), "wb") as f:
            f.write(bytes(data))
        if _judge_load(lambda: loaded[-1], lambda: _transformers_load(changed, {})).kind == "intact":
            return Outcome("intact", "the replaced file, read consistently (the change came before the plan)")
    return outcome


# ----------------------------------------------------------------- saves: disk full, killed
SAVE_LAYOUTS = {"one file": dict(), "4 shards": dict(max_shard_size="100KB"), "rank files": dict(distributed_checkpoint=True)}


def gen_disk_full(pick: Pick) -> Trial:
    return Trial("disk full", "save_on_full_disk", dict(
        old=pick.choice(sorted(SAVE_LAYOUTS)), new=pick.choice(sorted(SAVE_LAYOUTS)),
        how=pick.choice(["tmpfs", "rlimit"]), room_percent=pick.integer(0, 120)))


def gen_kill(pick: Pick) -> Trial:
    return Trial("kill during save", "kill_during_save", dict(
        old=pick.choice(sorted(SAVE_LAYOUTS)), new=pick.choice(sorted(SAVE_LAYOUTS)),
        at=pick.choice(KILL_POINTS),
        percent=pick.integer(0, 100)))


def _save_model(seed: int):
    from test_integrity_save import _model

    return _model(seed)


def _judge_folder(folder: str, old, new, *, rank_files: bool, error: BaseException | None) -> Outcome:
    """A folder after a save that may have failed: it must load as ``old`` or ``new`` whole (rank-local saves have no
    index to switch and may also leave a folder that does not load, never a mix)."""
    try:
        got = _state(_lowmem_load(folder))
    except Exception as e:  # noqa: BLE001
        if rank_files:
            return Outcome("named", f"rank files left unloadable ({type(e).__name__}), as documented")
        return Outcome("lost", f"the folder no longer loads: {type(e).__name__}: {_short(str(e), 300)}; files {sorted(os.listdir(folder))}")
    which = [name for name, model in (("old", old), ("new", new)) if _same_state(got, _state(model)) is None]
    if not which:
        return Outcome("lost", f"loads as neither checkpoint; files {sorted(os.listdir(folder))}")
    if error is None:
        return Outcome("intact", f"loads as {which[0]}")
    outcome = _classify_error(error)
    if which == ["new"] and outcome.kind == "named":
        return Outcome("named", "failed after the switch: " + outcome.detail)
    return outcome


def save_on_full_disk(ws, scratch, *, old, new, how, room_percent):
    """A re-save over a checkpoint with ``room_percent`` of the new checkpoint's bytes free (tmpfs, root only) or
    with a per-process file size limit (RLIMIT_FSIZE, at ``room_percent`` of one file's size)."""
    import errno

    import lowmem_hf
    from test_integrity_save import _leave_free

    old_model, new_model = _save_model(0), _save_model(1)
    if how == "tmpfs" and os.geteuid() == 0:
        disk = os.path.join(scratch, "disk")
        os.makedirs(disk)
        if os.system(f"mount -t tmpfs -o size=4m tmpfs {disk} >/dev/null 2>&1") != 0:
            how = "rlimit"
    else:
        how = "rlimit"
    try:
        if how == "rlimit":
            disk = scratch
        out = os.path.join(disk, "out")
        lowmem_hf.save_pretrained(old_model, out, **SAVE_LAYOUTS[old])
        needed = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out) if n.endswith(".safetensors"))
        error = None
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        if how == "tmpfs":
            _leave_free(disk, -(-needed * room_percent // 100 // 4096) * 4096)
        else:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (max(1, 380_000 * room_percent // 100), limit[1]))
        try:
            lowmem_hf.save_pretrained(new_model, out, **SAVE_LAYOUTS[new])
        except Exception as e:  # noqa: BLE001
            error = e
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        if error is not None and not (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EFBIG)):
            return _classify_error(error)
        if how == "tmpfs":
            os.remove(os.path.join(disk, "filler"))
        return _judge_folder(out, old_model, new_model, rank_files=new == "rank files" or old == "rank files", error=error)
    finally:
        if how == "tmpfs":
            os.system(f"umount {disk} >/dev/null 2>&1")


KILL_POINTS = ("os.replace", "os.remove", "os.link", "os.pwrite", "os.fsync", "os.open", "os.rmdir", "os.makedirs")
"""The calls a save is killed at: every write, rename, link and removal of its write-aside-then-switch."""


def kill_during_save(ws, scratch, *, old, new, at, percent):
    """A re-save in a grandchild that dies (SIGKILL) at one call of ``at`` (or, if the save makes none, of the next
    kill point it makes): the ``percent``-th percentile of those calls, counted by a first, unharmed save of the same
    models into a copy. The folder must load as the old or the new checkpoint, whole."""
    import lowmem_hf

    old_model, new_model = _save_model(0), _save_model(1)
    out, dry = os.path.join(scratch, "out"), os.path.join(scratch, "dry")
    lowmem_hf.save_pretrained(old_model, out, **SAVE_LAYOUTS[old])
    shutil.copytree(out, dry)
    counts = _save_in_grandchild(new_model, dry, SAVE_LAYOUTS[new])
    if counts is None:
        return Outcome("raw", "the save raised without a kill")
    points = KILL_POINTS[KILL_POINTS.index(at):] + KILL_POINTS[: KILL_POINTS.index(at)]
    at = next(p for p in points if counts.get(p))
    nth = 1 + (counts[at] - 1) * percent // 100
    status = _save_in_grandchild(new_model, out, SAVE_LAYOUTS[new], kill=(at, nth))
    if status != -signal.SIGKILL:
        return Outcome("raw", f"the save was to be killed at {at} call {nth} of {counts[at]}; it ended with {status}")
    outcome = _judge_folder(out, old_model, new_model, rank_files=new == "rank files" or old == "rank files", error=None)
    return Outcome(outcome.kind, f"killed at {at} call {nth} of {counts[at]}: {outcome.detail}")


def _save_in_grandchild(model, out: str, layout: dict, *, kill: tuple[str, int] | None = None):
    """Save ``model`` into ``out`` in a forked grandchild that counts its calls of each ``KILL_POINTS`` function.
    ``kill=(name, n)``: it SIGKILLs itself at the n-th call of ``name`` and this returns its exit status
    (``-SIGKILL``); else ``{name: calls}``, or None if the save raised."""
    import lowmem_hf

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        counts = dict.fromkeys(KILL_POINTS, 0)

        def counting(point):
            real = getattr(os, point.split(".")[1])

            def call(*args, **kwargs):
                counts[point] += 1
                if kill == (point, counts[point]):
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)

            return real, call

        reals = {}
        for point in KILL_POINTS:
            reals[point], patched = counting(point)
            setattr(os, point.split(".")[1], patched)
        try:
            lowmem_hf.save_pretrained(model, out, **layout)
        except BaseException:  # noqa: BLE001 - a save that raises without a kill: the caller says so
            os._exit(2)
        for point, real in reals.items():
            setattr(os, point.split(".")[1], real)
        os.write(write, json.dumps(counts).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        reported = f.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if kill is not None:
        return code
    return json.loads(reported) if code == 0 else None


def _die(ws, scratch, *, how):
    """The runner's self-test: a child that dies of a signal, or never returns."""
    if how == "signal":
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(3600)


# ------------------------------------------------------------------------------------------------- categories
GENERATORS: dict[str, Callable[[Pick], Trial]] = {
    "safetensors header": gen_safetensors_header,
    "index": gen_index,
    "dcp metadata": gen_dcp,
    "config": gen_config,
    "arguments": gen_arguments,
    "truncation": gen_truncation,
    "hub faults": gen_hub_fault,
    "disk full": gen_disk_full,
    "kill during save": gen_kill,
}
ACTIONS = {f.__name__: f for f in (damage_safetensors, damage_index, damage_dcp, damage_config, load_with_arguments,
                                   truncate_mid_load, load_through_hub_fault, save_on_full_disk, kill_during_save, _die)}


def _child(trial: Trial, workspace: dict, scratch: str, conn) -> None:
    """Runs in the forked child: quiet, one thread, the action's outcome sent back through ``conn``."""
    log = os.open(os.path.join(scratch, "child.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        outcome = ACTIONS[trial.action](workspace, scratch, **trial.params)
    except BaseException as e:  # noqa: BLE001 - a bug of the generator itself must show, not vanish
        outcome = Outcome("raw", f"the trial itself failed: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    conn.send(outcome)
    conn.close()


class Runner:
    """Runs trials in children forked from one fork server (which imported the stack once), with a time limit."""

    PRELOAD = ["torch", "transformers", "transformers.models.llama.modeling_llama", "lowmem_hf", "safetensors.torch",
               "torch.distributed.checkpoint", "integrity_fuzz", "hub_server", "checkpoints"]

    def __init__(self, workspace: dict, scratch_root: str, *, seconds: float = LOAD_SECONDS):
        self.workspace, self.scratch_root, self.seconds = workspace, scratch_root, seconds
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(self.PRELOAD)
        self.count = 0

    def run(self, trial: Trial) -> Outcome:
        self.count += 1
        scratch = tempfile.mkdtemp(prefix=f"trial{self.count:04d}-", dir=self.scratch_root)
        receive, send = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_child, args=(trial, self.workspace, scratch, send), daemon=True)
        process.start()
        send.close()
        outcome = None
        try:
            if receive.poll(self.seconds):
                with contextlib.suppress(EOFError):
                    outcome = receive.recv()
            process.join(5 if outcome is not None else 0.5)
            if process.is_alive():
                process.kill()
                process.join()
                if outcome is None:
                    outcome = Outcome("hang", f"still running after {self.seconds:.0f} s; killed")
            elif outcome is None:
                code = process.exitcode
                kind = "crash" if code is not None and code < 0 else "raw"
                name = signal.Signals(-code).name if code is not None and code < 0 else f"exit code {code}"
                outcome = Outcome(kind, f"the child died ({name}): {_tail(os.path.join(scratch, 'child.log'))}")
        finally:
            receive.close()
            _unmount_under(scratch)
            shutil.rmtree(scratch, ignore_errors=True)
        return outcome


def _tail(path: str, n: int = 800) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-n:].decode(errors="replace")
    except OSError:
        return ""


def _unmount_under(folder: str) -> None:
    with contextlib.suppress(OSError):
        with open("/proc/mounts") as f:
            for line in f:
                point = line.split()[1]
                if point.startswith(folder + os.sep):
                    os.system(f"umount {point} >/dev/null 2>&1")


def draw_trial(category: str, pick: Pick) -> Trial:
    return GENERATORS[category](pick)


def seeded_trials(category: str, count: int, seed: int) -> list[Trial]:
    """``count`` trials of ``category`` from ``random.Random`` seeded by ``(seed, category, i)``: the same list on
    every run."""
    return [draw_trial(category, RandomPick(random.Random(f"{seed}/{category}/{i}"))) for i in range(count)]
