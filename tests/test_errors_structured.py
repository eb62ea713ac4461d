"""Errors carry their parts as fields and survive a pickle round trip; bad input that would escape as an upstream
error is a named lowmem_hf error naming the argument or file, what was expected, what was found and the fix."""

import inspect
import json
import pickle
import shutil

import pytest

import lowmem_hf
from lowmem_hf import errors
from lowmem_hf.errors import (
    ArgumentTypeError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    HubConnectionError,
    OutsideCheckpointError,
    UnsupportedArgumentError,
    UpstreamAPIError,
    broken_rule,
)
from lowmem_hf.formats.safetensors import parse_header

Causal = lowmem_hf.LowMemAutoModelForCausalLM

FIELDS = ("file", "key", "subject", "rule", "expected", "found", "fix")


def fields(error) -> dict:
    return {name: getattr(error, name) for name in FIELDS}


# --- escapes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argument,value,expected",
    [
        ("subfolder", None, "a str path inside the checkpoint ('' for its top folder)"),
        ("subfolder", 5, "a str path inside the checkpoint ('' for its top folder)"),
        ("cache_dir", 5, "a str path to the HF cache folder, or None"),
    ],
)
def test_a_path_argument_of_the_wrong_type_is_named_before_any_io(make_checkpoint, argument, value, expected):
    with pytest.raises(ArgumentTypeError) as e:
        Causal.from_pretrained(make_checkpoint("llama", "sharded"), **{argument: value})
    found = f"{type(value).__name__} {value!r}"
    assert isinstance(e.value, TypeError)
    assert (e.value.key, e.value.expected, e.value.found) == (argument, expected, found)
    assert str(e.value).startswith(f"{argument} must be {expected}, got {found}. ") and e.value.fix in str(e.value)


def test_a_hub_5xx_on_config_json_is_a_hub_connection_error_naming_repo_file_and_revision(hf_hub, make_checkpoint):
    hf_hub.add_repo("org/llama", make_checkpoint("llama", "sharded"))
    hf_hub.fail_next(503, count=None, path="config.json")
    with pytest.raises(HubConnectionError) as e:
        Causal.from_pretrained("org/llama")
    assert (e.value.file, e.value.found) == ("config.json", "the server answered 503")
    assert str(e.value) == (
        "config.json (repo 'org/llama', revision main): downloading it failed 5 times; the last time the server "
        "answered 503. Check the network (or proxy) to the Hub and load again."
    )


def test_a_subfolder_leaving_a_hub_repo_is_refused_naming_it_and_the_repo(hf_hub, make_checkpoint):
    hf_hub.add_repo("org/llama", make_checkpoint("llama", "sharded"))
    with pytest.raises(OutsideCheckpointError) as e:
        Causal.from_pretrained("org/llama", subfolder="../..")
    assert (e.value.key, e.value.file, e.value.found) == ("subfolder", "../..", "'../..'")
    assert str(e.value).startswith("subfolder='../..' leaves the repo 'org/llama': ") and e.value.fix in str(e.value)
    assert hf_hub.requests == []  # refused before the first request


def test_a_config_path_that_is_nowhere_is_checkpoint_not_found_naming_it(make_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative name that is also a valid Hub repo id, and no such folder here
    with pytest.raises(CheckpointNotFoundError) as e:
        Causal.from_pretrained(make_checkpoint("llama", "sharded"), config="no_such_folder")
    assert (e.value.key, e.value.file) == ("config", "no_such_folder")
    assert str(e.value).startswith("config='no_such_folder' names no local folder or file and no Hub repo that could be loaded")
    assert e.value.fix in str(e.value)


def test_an_index_entry_outside_the_folder_names_the_entry(make_checkpoint, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(make_checkpoint("llama", "sharded"), folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(OutsideCheckpointError) as e:
        Causal.from_pretrained(folder)
    assert e.value.file == "../elsewhere.safetensors"
    assert str(e.value).startswith("model.safetensors.index.json maps 'lm_head.weight' to '../elsewhere.safetensors': ")


def test_a_header_key_with_a_lone_surrogate_is_refused_naming_file_and_key():
    raw = json.dumps({"\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()  # "\\ud800"
    assert b"\\ud800" in raw
    with pytest.raises(CorruptCheckpointError) as e:
        parse_header(raw, header_len=len(raw), file_size=8 + len(raw) + 4, name="model.safetensors")
    assert fields(e.value) == {
        "file": "model.safetensors", "key": "\ud800", "subject": "key '\\ud800'", "rule": "header JSON",
        "expected": "UTF-8 text", "found": "a lone surrogate escape, which is not UTF-8", "fix": e.value.fix,
    }
    assert str(e.value).startswith(
        "model.safetensors: key '\\ud800' breaks the safetensors rule 'header JSON': expected UTF-8 text, found a lone "
        "surrogate escape, which is not UTF-8. "
    )


# --- fields and the builder -------------------------------------------------------------------------------------


def test_a_broken_format_rule_carries_its_parts(tmp_path):
    raw = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}'
    with pytest.raises(CorruptCheckpointError) as e:
        parse_header(raw, header_len=len(raw), file_size=8 + len(raw) + 4, name="model.safetensors")
    assert (e.value.file, e.value.key, e.value.subject, e.value.rule) == ("model.safetensors", "w", "tensor 'w'", "byte size")
    assert (e.value.expected, e.value.found) == ("8 bytes (F32 x [2])", "data_offsets [0, 4] (4 bytes)")
    assert str(e.value) == (
        f"model.safetensors: tensor 'w' breaks the safetensors rule 'byte size': expected {e.value.expected}, "
        f"found {e.value.found}. {e.value.fix}"
    )


def test_broken_rule_without_a_rulebook_says_the_rule():
    error = broken_rule("a.bin", "zip member 'a/x'", "stored", "method 0", "method 8", fix="Re-save it.")
    assert str(error) == "a.bin: zip member 'a/x' breaks the rule 'stored': expected method 0, found method 8. Re-save it."


# --- pickling ---------------------------------------------------------------------------------------------------

_SPECIAL = {
    UnsupportedArgumentError: lambda: UnsupportedArgumentError("device_map", "device_map='disk' is not supported."),
    UpstreamAPIError: lambda: UpstreamAPIError("tp", needs="DTensor", found="torch 2.0", fix="upgrade torch"),
}


def _exported_exceptions() -> list[type]:
    return [
        value for name in errors.__all__
        if inspect.isclass(value := getattr(errors, name)) and issubclass(value, BaseException)
    ]


def _example(cls: type) -> BaseException:
    if cls in _SPECIAL:
        return _SPECIAL[cls]()
    if issubclass(cls, errors.LowMemError):
        return cls("model.safetensors: something is off.", file="model.safetensors", key="w", rule="r", fix="Fix it.")
    return cls("a warning")


@pytest.mark.parametrize("cls", _exported_exceptions(), ids=lambda c: c.__name__)
def test_every_exception_survives_a_pickle_round_trip(cls):
    error = _example(cls)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error) and back.args == error.args
    assert vars(back) == vars(error)


def test_every_exception_is_exported():
    defined = {v for v in vars(errors).values() if inspect.isclass(v) and issubclass(v, BaseException) and v.__module__ == errors.__name__}
    assert defined == set(_exported_exceptions())


def test_a_round_trip_keeps_the_fields_and_the_built_in_base():
    error = pickle.loads(pickle.dumps(broken_rule("f.safetensors", "tensor 'w'", "entry", "x", "y", fix="z", key="w", rulebook="safetensors")))
    assert isinstance(error, OSError) and fields(error) == {
        "file": "f.safetensors", "key": "w", "subject": "tensor 'w'", "rule": "entry", "expected": "x", "found": "y", "fix": "z",
    }
    argument = pickle.loads(pickle.dumps(_SPECIAL[UnsupportedArgumentError]()))
    assert argument.argument == argument.key == "device_map" and isinstance(argument, NotImplementedError)


def test_moved_exceptions_are_importable_where_they_were():
    from lowmem_hf.cli import UsageError
    from lowmem_hf.patch import FallbackWarning
    from lowmem_hf.plan.sharding import UnsupportedStyleError

    assert (UsageError, FallbackWarning, UnsupportedStyleError) == (errors.UsageError, errors.FallbackWarning, errors.UnsupportedStyleError)
    assert issubclass(UnsupportedStyleError, NotImplementedError) and issubclass(FallbackWarning, UserWarning)
