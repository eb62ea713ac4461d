"""Every exception lowmem_hf raises on purpose.

Each subclasses the closest built-in so callers that already catch ``OSError`` / ``ValueError`` /
``RuntimeError`` around ``from_pretrained`` keep working. Messages name the file or key, what was
expected, what was found, and how to fix it, and carry those parts as attributes (``LowMemError``'s fields) where
the raise site has them. Every exception survives a pickle round trip: errors cross ranks and child processes.
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
    "ArgumentTypeError",
    "NothingToLoadError",
    "RankFailedError",
    "RemoteFileChangedError",
    "OutsideCheckpointError",
    "CorruptDownloadError",
    "RemoteConnectionError",
    "HubConnectionError",
    "ObjectStoreError",
    "ObjectStoreCredentialsError",
    "OversizedModelError",
    "UpstreamAPIError",
    "UnsupportedStyleError",
    "UsageError",
    "FallbackWarning",
    "broken_rule",
]


def short_repr(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for the values error messages quote."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class LowMemError(Exception):
    """Base class of the errors below; never raised itself.

    The fields are the parts of the message, for code that handles the error rather than prints it; each is None
    where the raise site does not have that part (most raises fill ``file`` and ``key`` at most).

    Attributes:
        file: the file (or folder, or index entry) the error is about, as the message names it.
        key: the tensor key or the argument the error is about.
        subject: what broke the rule, as the message names it (``"tensor 'w'"``, ``"zip member 'a/data/0'"``).
        rule: the rule broken, by its name in the format's checks (``'contiguous offsets'``).
        expected: what the rule asks for, as the message shows it.
        found: what is there instead, as the message shows it.
        fix: how to fix it.
    """

    def __init__(
        self, *args, file: str | None = None, key: str | None = None, subject: str | None = None, rule: str | None = None,
        expected: str | None = None, found: str | None = None, fix: str | None = None,
    ):
        super().__init__(*args)
        self.file, self.key, self.subject, self.rule = file, key, subject, rule
        self.expected, self.found, self.fix = expected, found, fix

    def __reduce__(self):
        # rebuilt from ``args`` without calling ``__init__`` (a subclass's may take other arguments), then the fields
        return _restore, (type(self), self.args), self.__dict__


def _restore(cls: type, args: tuple) -> BaseException:
    error = cls.__new__(cls, *args)
    error.args = args  # OSError's __new__ leaves them to __init__ where a subclass defines one
    return error


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
        super().__init__(message, key=argument)
        self.argument = argument


class ArgumentTypeError(LowMemError, TypeError):
    """An argument of a type that has no meaning for it; ``key`` names the argument, ``expected`` and ``found`` the
    types."""


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


class RemoteConnectionError(LowMemError, ConnectionError):
    """A remote store (the Hub, an object store) did not deliver a file's bytes after every retry; the subclass says
    which kind of store. Catch this one to handle both."""


class HubConnectionError(RemoteConnectionError):
    """The Hub did not deliver a file's bytes after every retry: the connection kept dropping, or the server kept
    answering a retryable status (5xx, 408, 429). The message names the file and what the last attempt met."""


class ObjectStoreError(RemoteConnectionError):
    """An object store (``s3://...``, any fsspec store) did not deliver an object's bytes after every retry: it kept
    answering 5xx or SlowDown, or the connection kept dropping or stalling. The message names the object and the last
    answer (``file``: the object's URL; ``found``: the last answer)."""


class ObjectStoreCredentialsError(LowMemError, PermissionError):
    """An object store found no credentials, or refused the ones it was given (403). The message names the bucket and
    what to set; it never shows a credential."""


class OversizedModelError(LowMemError, ValueError):
    """The config builds a model vastly larger than the checkpoint (a size such as ``num_hidden_layers`` is off):
    refused while the model is built on ``meta``, where building it would take unbounded time and memory."""


class UpstreamAPIError(LowMemError, NotImplementedError):
    """A feature needs a name that the installed torch, transformers or DeepSpeed release does not have.

    Raised where the feature is used, never at import: ``lowmem_hf.compat`` looks each such name up on demand.
    ``feature``, ``needs``, ``found`` and ``fix`` are the message's parts.
    """

    def __init__(self, feature: str, *, needs: str, found: str, fix: str):
        super().__init__(f"{feature} needs {needs}, which {found} does not have. Fix: {fix}.", found=found, fix=fix)
        self.feature, self.needs = feature, needs


class UnsupportedStyleError(LowMemError, NotImplementedError):
    """A TP style lowmem_hf cannot slice at read time."""


class UsageError(LowMemError):
    """Bad command-line input: printed as one line, exit status 2, no traceback."""


class FallbackWarning(UserWarning):
    """A ``from_pretrained`` call under the switch was handed to transformers' own loader.

    A warning, not an error, so not a ``LowMemError``: it is never raised unless the caller turns warnings into errors.
    """


def broken_rule(
    file: str, subject: str, rule: str, expected: str, found: str, *, fix: str, rulebook: str = "", key: str | None = None,
) -> CorruptCheckpointError:
    """The error for a checkpoint file that breaks one of its format's rules: the message and the fields from the
    same parts, ``"{file}: {subject} breaks the {rulebook} rule {rule!r}: expected {expected}, found {found}. {fix}"``.

    Args:
        file: the file (or checkpoint folder) that breaks the rule.
        subject: what in it breaks the rule (``"tensor 'w'"``); ``key``: the tensor key, where there is one.
        rule: the rule's name; ``rulebook``: whose rules they are (``"safetensors"``, ``"DCP"``; empty for none).
        expected, found, fix: what the rule asks for, what is there, and what to do.

    Returns:
        A ``CorruptCheckpointError`` to raise, with ``file``, ``key``, ``subject``, ``rule``, ``expected``, ``found``
        and ``fix`` set.

    Example::

        raise broken_rule("model.safetensors", "tensor 'w'", "byte size", "16 bytes", "12", fix="Copy it again.", key="w")
    """
    rules = f"{rulebook} rule" if rulebook else "rule"
    return CorruptCheckpointError(
        f"{file}: {subject} breaks the {rules} {rule!r}: expected {expected}, found {found}. {fix}",
        file=file, key=key, subject=subject, rule=rule, expected=expected, found=found, fix=fix,
    )
