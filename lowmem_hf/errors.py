"""Every exception lowmem_hf raises on purpose.

Each subclasses the closest built-in so callers that already catch ``OSError`` / ``ValueError`` /
``RuntimeError`` around ``from_pretrained`` keep working. Messages name the file or key, what was
expected, what was found, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "LowMemError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "MissingShardError",
    "MissingKeyError",
    "ShapeMismatchError",
    "UnsupportedConversionError",
    "IncompleteLoadError",
    "UnsupportedArgumentError",
    "NothingToLoadError",
    "RankFailedError",
    "RemoteFileChangedError",
    "OutsideCheckpointError",
    "CorruptDownloadError",
    "HubConnectionError",
    "OversizedModelError",
    "UpstreamAPIError",
]


def short_repr(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for the values error messages quote."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class LowMemError(Exception):
    """Base class of the errors below; never raised itself."""


class CheckpointNotFoundError(LowMemError, OSError):
    """No config or no weight file where the caller pointed."""


class CorruptCheckpointError(LowMemError, OSError):
    """A weight file exists but its header or size is not what the format promises."""


class MissingShardError(CheckpointNotFoundError):
    """An index names a shard file that is not there."""


class MissingKeyError(CorruptCheckpointError):
    """A sharded training checkpoint lacks a tensor the model needs (resuming must not silently re-initialize)."""


class ShapeMismatchError(LowMemError, RuntimeError):
    """A checkpoint tensor's shape differs from the parameter it maps to (without ``ignore_mismatched_sizes``)."""


class UnsupportedConversionError(LowMemError, NotImplementedError):
    """transformers would convert these checkpoint keys in a way lowmem_hf cannot stream."""


class NothingToLoadError(LowMemError, ValueError):
    """Not one checkpoint tensor fits the model: the result would be a fully re-initialized model, never a load."""


class IncompleteLoadError(LowMemError, RuntimeError):
    """A post-condition failed: something is still on ``meta`` or has a dtype the policy did not decide."""


class UnsupportedArgumentError(LowMemError, NotImplementedError):
    """A transformers ``from_pretrained`` argument (or value) whose behaviour lowmem_hf does not implement.

    ``argument`` names it, so the one-line switch can hand the call to transformers' own loader and say why.
    """

    def __init__(self, argument: str, message: str):
        super().__init__(message)
        self.argument = argument


class RankFailedError(LowMemError, RuntimeError):
    """Another rank of a cooperative Hub fetch died or failed; the message names it."""


class RemoteFileChangedError(LowMemError, OSError):
    """A remote file no longer matches the size/etag the load was planned with."""


class OutsideCheckpointError(LowMemError, ValueError):
    """A weight file the checkpoint names (``config.transformers_weights``, an index entry, a symlink, a subfolder or
    variant) resolves outside the checkpoint folder, or for a Hub repo outside that repo's HF cache folder. Refused
    before any byte of it is read; the message names the entry."""


class CorruptDownloadError(CorruptCheckpointError):
    """A file downloaded from the Hub does not hash to the sha256 the Hub publishes for it (its ETag), on the first
    download and on the one retry. The corrupt copy is no longer in the HF cache."""


class HubConnectionError(LowMemError, ConnectionError):
    """The Hub did not deliver a file's bytes after every retry: the connection kept dropping, or the server kept
    answering a retryable status (5xx, 408, 429). The message names the file and what the last attempt met."""


class OversizedModelError(LowMemError, ValueError):
    """The config builds a model vastly larger than the checkpoint (a size such as ``num_hidden_layers`` is off):
    refused while the model is built on ``meta``, where building it would take unbounded time and memory."""


class UpstreamAPIError(LowMemError, NotImplementedError):
    """A feature needs a name that the installed torch, transformers or DeepSpeed release does not have.

    Raised where the feature is used, never at import: ``lowmem_hf.compat`` looks each such name up on demand.
    ``feature``, ``needs``, ``found`` and ``fix`` are the message's parts.
    """

    def __init__(self, feature: str, *, needs: str, found: str, fix: str):
        super().__init__(f"{feature} needs {needs}, which {found} does not have. Fix: {fix}.")
        self.feature, self.needs, self.found, self.fix = feature, needs, found, fix

    def __reduce__(self):
        # errors cross ranks and child processes pickled; the keyword-only constructor needs its fields back
        return _rebuild_upstream_api_error, (self.feature, self.needs, self.found, self.fix)


def _rebuild_upstream_api_error(feature: str, needs: str, found: str, fix: str) -> UpstreamAPIError:
    return UpstreamAPIError(feature, needs=needs, found=found, fix=fix)
