"""The commit protocol of a save: write aside, switch at the end, clean up.

Every new file is written into ``<dir>/.lowmem_hf_save.partial/`` and fsync'd (``Staging``). Only after every
rank reported success (``agree``: a failure on one rank fails all, none hangs) are they renamed into place, in an
order that leaves a loader a complete checkpoint at every instant. transformers and lowmem_hf read
``model.safetensors`` when it is there, else ``model.safetensors.index.json`` and the shards it names; so a one-file
checkpoint switches with the rename of ``model.safetensors``, a sharded one with the rename of its index (or, when
an older ``model.safetensors`` was what loaders read, with its removal). Shard names that the live index still names
are replaced only after the index has been pointed at second names (hard links) of the new shards. The previous
checkpoint's files go only after the switch (``switch_gathered``).

A failed save removes what it wrote and leaves the folder as it was; a killed save leaves the old or the new
checkpoint loadable, plus at most the staging folder and (killed mid-switch) the second names, which the next save
removes. The rank-local format (``distributed_checkpoint=True``) has no index to switch: its old rank files are
removed just before the new ones are renamed in (``switch_rank_files``), so a kill in that moment leaves a folder
that does not load (lowmem_hf checks that the rank files cover every tensor), never one that mixes two saves.

Nothing here knows a model or a tensor: the writers hand over file names and bytes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil

from .agree import Failure, agree, os_failure

__all__ = [
    "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "STAGING", "Staging", "prepare_directory", "pwrite_all",
    "live_weights", "switch_gathered", "switch_rank_files",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
STAGING = ".lowmem_hf_save.partial"  # the folder inside save_directory where new files are written aside
_WRITE_BYTES = 64 * 1024 * 1024  # bytes per write() call
_HUB_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_RANK_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
_SECOND_NAME = re.compile(r"model-\d{5}-of-\d{5}\.next\.safetensors")  # see _point_index_at_second_names


class Staging:
    """This rank's new files, written into ``<directory>/.lowmem_hf_save.partial/`` and fsync'd; moved into place
    by the switch after every rank agreed, removed otherwise. The first failure is kept (with the bytes needed)
    and the rank goes on taking part in every exchange, so that no other rank hangs."""

    def __init__(self, directory: str, *, weight_bytes: int, writer: bool, max_shard_size_applies: bool):
        self.directory = directory
        self.folder = os.path.join(directory, STAGING)
        self.writer = writer
        self.max_shard_size_applies = max_shard_size_applies
        """Whether a smaller ``max_shard_size`` makes smaller files (not in the rank-local format)."""
        self.weight_bytes = weight_bytes
        """The new checkpoint's tensor bytes (all ranks together)."""
        self.free_bytes = _free_bytes(directory) if writer else None
        """What the device had free when the save began (``None``: unknown)."""
        self.names: list[str] = []
        """The weight files this rank wrote, in order."""
        self.configs: list[str] = []
        """The config files rank 0 wrote (config.json, generation_config.json, remote code)."""
        self.failure: Failure | None = None
        self.cause: BaseException | None = None

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def create(self, name: str, size: int, *, weights: bool = True) -> int | None:
        """A new file of ``size`` bytes open for writing, or ``None`` once this rank has failed."""
        if self.failure is not None:
            return None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as e:
            self.fail(name, e, size)
            return None
        if weights:
            self.names.append(name)
        return fd

    def close(self, fd: int | None, name: str, size: int) -> None:
        """fsync (some file systems report a full disk only here) and close."""
        if fd is None:
            return
        try:
            if self.failure is None:
                os.fsync(fd)
        except OSError as e:
            self.fail(name, e, size)
        finally:
            try:
                os.close(fd)
            except OSError as e:
                self.fail(name, e, size)

    def write_file(self, name: str, data: bytes, *, weights: bool = False) -> None:
        """A small file, whole (the index; ``weights``: a weight file the switch moves into place)."""
        fd = self.create(name, len(data), weights=weights)
        if fd is not None:
            try:
                pwrite_all(fd, memoryview(data), 0)
            except OSError as e:
                self.fail(name, e, len(data))
            self.close(fd, name, len(data))

    def fail(self, name: str, error: BaseException, size: int | None) -> None:
        """Keep the first failure, described for the user: the file's final path, why, and the bytes needed."""
        if self.failure is not None:
            return
        path = os.path.join(self.directory, name)
        if not isinstance(error, OSError):
            self.failure, self.cause = os_failure(None, f"{path}: {type(error).__name__}: {error}"), error
            return
        text = f"writing {path}: {error.strerror or error}"
        code = error.errno
        if code in (errno.ENOSPC, errno.EDQUOT):
            text += self._short_of_space(size)
        elif code == errno.EFBIG:
            text += f" (it needs {size} bytes, more than one file may hold here)"
            text += ". Pass a smaller max_shard_size." if self.max_shard_size_applies else "."
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            text += f". Check the permissions of {self.directory}."
        self.failure, self.cause = os_failure(code, text), error

    def _short_of_space(self, size: int | None) -> str:
        """What a full disk needs: the file, the whole checkpoint, and what was free when the save began."""
        needs = f"The file needs {size} bytes and the" if size is not None else "The"
        text = (
            f". {needs} new checkpoint's weights need {self.weight_bytes} bytes in all, next to the files already "
            "in the folder (those are replaced only once the new ones are complete)"
        )
        if self.free_bytes is not None:
            short = self.weight_bytes - self.free_bytes
            text += f"; the device had {self.free_bytes} bytes free when the save began"
            text += f", {short} bytes short" if short > 0 else ""
        return text + ". Free space on the device, or save to another folder."

    def discard(self) -> None:
        """Remove the staging folder and whatever is left in it (after a failure: everything this save wrote)."""
        if self.writer:
            shutil.rmtree(self.folder, ignore_errors=True)


def prepare_directory(directory: str) -> Failure | None:
    """``None`` if ``directory`` can take the files, else why not (nothing is written either way). Removes what a
    killed save left in the staging folder."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return os_failure(e.errno, f"cannot create the save directory {directory}: {e.strerror or e}")
    if not os.access(directory, os.W_OK | os.X_OK):
        return os_failure(errno.EACCES, f"the save directory {directory} is not writable by this process (check its permissions)")
    shutil.rmtree(os.path.join(directory, STAGING), ignore_errors=True)
    return None


def _free_bytes(directory: str) -> int | None:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset``, ``_WRITE_BYTES`` per call, through short writes."""
    while len(view):
        written = os.pwrite(fd, view[:_WRITE_BYTES], offset)
        view, offset = view[written:], offset + written


def live_weights(directory: str) -> set[str]:
    """The weight files a loader reads in ``directory`` now: ``model.safetensors`` if it is there (transformers and
    lowmem_hf look for it first), else the index and the files it names."""
    if os.path.isfile(os.path.join(directory, SAFE_WEIGHTS_NAME)):
        return {SAFE_WEIGHTS_NAME}
    index = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        return set()
    try:
        with open(index, encoding="utf-8") as f:
            named = {v for v in json.load(f)["weight_map"].values() if isinstance(v, str) and os.sep not in v}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        named = set()  # an unreadable index: nothing loads from it anyway
    return {SAFE_WEIGHTS_INDEX_NAME} | named


def _is_weight_file(name: str) -> bool:
    """A file a save of lowmem_hf (or transformers) writes, hence replaced by the next save into the folder."""
    return name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or any(
        p.fullmatch(name) for p in (_HUB_SHARD, _RANK_SHARD, _SECOND_NAME)
    )


def _remove(directory: str, name: str) -> None:
    try:
        os.remove(os.path.join(directory, name))
    except FileNotFoundError:
        pass


def _fsync_directory(directory: str) -> None:
    """Make the renames durable (best effort: some file systems cannot fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _move_configs(staging: Staging) -> None:
    for name in staging.configs:
        os.replace(os.path.join(staging.path("config"), name), os.path.join(staging.directory, name))


def switch_gathered(staging: Staging, index: dict | None) -> None:
    """Rank 0, after every rank agreed: move the new files into place so that a loader sees the old checkpoint,
    then the new one, never a mix; then remove what the old one held and the new one does not.

    ``index``: the new ``model.safetensors.index.json`` (already written aside) when the checkpoint is sharded,
    ``None`` for one ``model.safetensors``.
    """
    directory, weights = staging.directory, staging.names
    live = live_weights(directory)
    _move_configs(staging)  # small, and a checkpoint step rarely changes them
    if index is None:
        os.replace(staging.path(SAFE_WEIGHTS_NAME), os.path.join(directory, SAFE_WEIGHTS_NAME))  # the switch
    else:
        if live & set(weights):
            _point_index_at_second_names(staging, index)  # the switch, when the old index was live
        for name in weights:
            os.replace(staging.path(name), os.path.join(directory, name))
        os.replace(staging.path(SAFE_WEIGHTS_INDEX_NAME), os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME))  # or here
        _remove(directory, SAFE_WEIGHTS_NAME)  # the switch, when an older model.safetensors was live
    _fsync_directory(directory)
    keep = set(weights) | ({SAFE_WEIGHTS_INDEX_NAME} if index is not None else set())
    for name in os.listdir(directory):
        if name not in keep and (_is_weight_file(name) or (name in live and name.endswith(".safetensors"))):
            _remove(directory, name)


def _point_index_at_second_names(staging: Staging, index: dict) -> None:
    """The live index names files the new shards are about to replace. Give every new shard a second name (a hard
    link, no copy), then point the live index at those: the new checkpoint is then what loaders read, and the
    final names can be replaced. Where the file system has no hard links, remove the old index instead: until the
    new one is renamed in the folder does not load (it never mixes two checkpoints)."""
    directory = staging.directory
    second = {name: name.removesuffix(".safetensors") + ".next.safetensors" for name in staging.names}
    try:
        for name, other in second.items():
            _remove(directory, other)
            os.link(staging.path(name), os.path.join(directory, other))
    except OSError:
        for other in second.values():
            _remove(directory, other)
        _remove(directory, SAFE_WEIGHTS_INDEX_NAME)
        return
    bridge = dict(index, weight_map={k: second[v] for k, v in index["weight_map"].items()})
    path = staging.path(SAFE_WEIGHTS_INDEX_NAME + ".next")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(bridge, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path, os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME))


def switch_rank_files(staging: Staging, group, rank: int, keep: set[str]) -> None:
    """Every rank, after every rank agreed: move the rank files of ``distributed_checkpoint=True`` into place.

    That format has no index: loaders read every ``shard-*`` file, unless a Hub-layout checkpoint is there, which
    takes precedence. So with none there, rank 0 removes the old rank files before any new one lands (a reader sees
    an incomplete set, never old and new files together); then every rank renames its file; then rank 0 removes
    a Hub-layout checkpoint (the switch, if it was live: the index first, ``model.safetensors`` last) and the rank
    files of an earlier save with more ranks. ``keep``: the rank files every rank wrote.
    """
    directory = staging.directory

    def step(action, ranks) -> None:
        failure = None
        if ranks is None or rank in ranks:
            try:
                action()
            except OSError as e:
                failure = os_failure(e.errno, f"moving the new files into {directory}: {e}")
        agree(failure, group, what="switch to the new checkpoint", outcome="the folder may hold no complete checkpoint")

    def clear_old_rank_files() -> None:
        _move_configs(staging)
        if not live_weights(directory):
            for name in os.listdir(directory):
                if _RANK_SHARD.fullmatch(name):
                    _remove(directory, name)

    def move_own_files() -> None:
        for name in staging.names:
            os.replace(staging.path(name), os.path.join(directory, name))
        _fsync_directory(directory)

    def remove_the_rest() -> None:
        for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME):
            _remove(directory, name)
        for name in os.listdir(directory):
            if _is_weight_file(name) and name not in keep:
                _remove(directory, name)

    step(clear_old_rank_files, ranks=(0,))
    step(move_own_files, ranks=None)
    step(remove_the_rest, ranks=(0,))  # the ranks return together
