"""Under the switch a call does what it does under transformers, also where the direct API is deliberately stricter:
a checkpoint of which nothing fits, a weight file linked into a sibling ``blobs/`` folder (the HF cache's layout),
and the loading info of a classifier reloaded with another number of labels."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import lowmem_hf
from lowmem_hf.patch import FallbackWarning
from test_equivalence import assert_same_model


@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    lowmem_hf.unpatch_transformers()


def _both(call):
    """``call()`` plain, then under the switch, each from seed 0; ``(plain, switched, fallback warnings)``."""
    torch.manual_seed(0)
    plain = call()
    with lowmem_hf.patch_transformers(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        switched = call()
    return plain, switched, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]


def test_a_checkpoint_holding_one_unrelated_tensor_loads_as_transformers_loads_it(make_checkpoint, tmp_path):
    # transformers' mixin test_model_weights_reload_no_missing_tied_weights, for every architecture it covers
    folder = shutil.copytree(make_checkpoint("llama", "safetensors"), tmp_path / "nuked")
    save_file({"tensor": torch.tensor([1, 2])}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(lowmem_hf.NothingToLoadError, match=r"Not one of the 1 tensors .* match no parameter"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(folder)  # the direct API: never a load

    (ref, ref_info), (got, got_info), fallbacks = _both(lambda: AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True))
    assert len(fallbacks) == 1 and "loads none of the checkpoint's tensors" in fallbacks[0] and "NothingToLoad" not in fallbacks[0]
    assert got_info == ref_info and ref_info["missing_keys"] and ref_info["unexpected_keys"] == {"tensor"}
    assert not hasattr(got, "lowmem_report")
    assert_same_model(ref, got)


def test_a_checkpoint_of_another_architecture_loads_into_a_model_class_as_transformers_loads_it(make_checkpoint):
    # transformers' test_model_from_pretrained_with_different_pretrained_model_name loads a T5 into BertModel
    llama = make_checkpoint("llama", "safetensors")
    ref, got, fallbacks = _both(lambda: transformers.BertModel.from_pretrained(llama))
    assert len(fallbacks) == 1 and "BertModel.from_pretrained" in fallbacks[0]
    assert_same_model(ref, got)


def _snapshot_beside_blobs(source: str, root) -> str:
    """``root/snapshot/<file> -> root/blobs/<file>`` for every weight file, config.json naming its weights."""
    blobs, snapshot = root / "blobs", root / "snapshot"
    shutil.copytree(source, blobs)
    snapshot.mkdir()
    config = json.loads((blobs / "config.json").read_text())
    config["transformers_weights"] = "model.safetensors"
    (snapshot / "config.json").write_text(json.dumps(config))
    os.symlink(blobs / "model.safetensors", snapshot / "model.safetensors")
    return str(snapshot)


def test_a_weight_file_linked_into_the_sibling_blobs_folder_loads(make_checkpoint, tmp_path):
    # transformers' test_transformers_weights_allows_symlinked_snapshot_file: the HF cache's own layout
    source = make_checkpoint("llama", "safetensors")
    snapshot = _snapshot_beside_blobs(source, tmp_path)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(source)
    torch.manual_seed(0)
    direct = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(snapshot)
    assert_same_model(ref, direct, same_source=False)  # config.json differs: it names its weight file
    plain, switched, fallbacks = _both(lambda: AutoModelForCausalLM.from_pretrained(snapshot))
    assert fallbacks == [] and hasattr(switched, "lowmem_report")
    assert_same_model(plain, switched)


@pytest.mark.parametrize("elsewhere", ["blobs-of-another-folder", "not-named-blobs"])
def test_a_weight_file_linked_anywhere_else_outside_is_still_refused(make_checkpoint, tmp_path, elsewhere):
    snapshot = _snapshot_beside_blobs(make_checkpoint("llama", "safetensors"), tmp_path)
    target = tmp_path / ("other/blobs" if elsewhere == "blobs-of-another-folder" else "weights")
    target.mkdir(parents=True)
    shutil.move(tmp_path / "blobs" / "model.safetensors", target / "model.safetensors")
    os.remove(os.path.join(snapshot, "model.safetensors"))
    os.symlink(target / "model.safetensors", os.path.join(snapshot, "model.safetensors"))
    with pytest.raises(lowmem_hf.OutsideCheckpointError, match=rf"a symlink to {target / 'model.safetensors'}, outside"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(snapshot)


@pytest.fixture(scope="module")
def three_label_classifier(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=3, pad_token_id=0,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("classifier")
    transformers.LlamaForSequenceClassification(config).save_pretrained(folder)
    return str(folder)


def test_a_classifier_reloaded_with_more_labels_reports_loading_info_as_transformers(three_label_classifier):
    # transformers' run_glue.py flow: num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True
    kwargs = dict(num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True)
    (ref, ref_info), (got, got_info), fallbacks = _both(
        lambda: AutoModelForSequenceClassification.from_pretrained(three_label_classifier, **kwargs)
    )
    assert fallbacks == [] and hasattr(got, "lowmem_report")
    assert got_info == ref_info
    assert ref_info["missing_keys"] == set()
    assert ref_info["mismatched_keys"] == {("score.weight", torch.Size([3, 16]), torch.Size([5, 16]))}
    (_, stored, wanted), = got_info["mismatched_keys"]
    assert type(stored) is torch.Size and type(wanted) is torch.Size
    assert_same_model(ref, got)

    torch.manual_seed(0)
    _, report = lowmem_hf.LowMemAutoModelForSequenceClassification.from_pretrained(three_label_classifier, **kwargs)
    assert report.missing_keys == frozenset() and report.to_dict() == ref_info
