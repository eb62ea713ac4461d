"""``import lowmem_hf`` costs what ``import transformers`` costs: torch and the modeling code wait for first use.

Each check runs in a fresh interpreter, since this test process has long imported everything. Timing and memory
are measured by ``benchmarks/bench_import.py``; these tests pin down the behaviour that makes them small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import lowmem_hf

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What `import lowmem_hf` must not load eagerly: ~200 MiB of torch and transformers' modeling code.
HEAVY = (
    "torch",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.core_model_loading",
    "lowmem_hf.auto",
    "lowmem_hf.load",
)


def _fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it ends by printing one JSON document, which is returned."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _loaded(statement: str) -> dict:
    code = f"import json, sys\n{statement}\nprint(json.dumps({{'modules': sorted(sys.modules)}}))"
    return _fresh(code)


def test_import_loads_no_torch_and_no_modeling_code():
    loaded = set(_loaded("import lowmem_hf")["modules"])
    assert [m for m in HEAVY if m in loaded] == []


def test_import_adds_only_lowmem_hf_and_the_standard_library_to_what_import_transformers_loads():
    transformers_alone = set(_loaded("import transformers")["modules"])
    extra = set(_loaded("import lowmem_hf")["modules"]) - transformers_alone
    assert sorted(m for m in extra if m.split(".")[0] not in ("lowmem_hf", *sys.stdlib_module_names)) == []


def test_a_public_name_read_after_import_loads_its_module_and_works():
    found = _fresh(
        "import json, sys, transformers\n"
        "import lowmem_hf\n"
        "cls = lowmem_hf.LowMemAutoModelForCausalLM\n"
        "print(json.dumps({'base': issubclass(cls, lowmem_hf.LowMemAutoModelBase),"
        " 'auto_class': cls._auto_class is transformers.AutoModelForCausalLM,"
        " 'modeling_utils': 'transformers.modeling_utils' in sys.modules}))"
    )
    assert found == {"base": True, "auto_class": True, "modeling_utils": True}


def test_from_import_of_an_auto_class_works_in_a_fresh_process():
    found = _fresh(
        "import json\nfrom lowmem_hf import LowMemAutoModelForCausalLM, LowMemAutoModelForSequenceClassification, LoadReport\n"
        "print(json.dumps([LowMemAutoModelForCausalLM.__name__, LowMemAutoModelForSequenceClassification.__name__, LoadReport.__name__]))"
    )
    assert found == ["LowMemAutoModelForCausalLM", "LowMemAutoModelForSequenceClassification", "LoadReport"]


def test_checking_or_undoing_the_switch_loads_no_modeling_code():
    found = _fresh(
        "import json, sys\nimport lowmem_hf\nlowmem_hf.unpatch_transformers()\npatched = lowmem_hf.is_patched()\n"
        f"print(json.dumps({{'patched': patched, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))"
    )
    assert found == {"patched": False, "heavy": []}


def test_star_import_and_dir_offer_every_public_name():
    found = _fresh(
        "import json\nimport lowmem_hf\nnames = {}\nexec('from lowmem_hf import *', names)\n"
        "print(json.dumps({'star': sorted(n for n in names if not n.startswith('__')), 'all': sorted(lowmem_hf.__all__),"
        " 'dir_has_all': set(lowmem_hf.__all__) <= set(dir(lowmem_hf)), 'dir_has_auto_classes': 'AUTO_CLASSES' in dir(lowmem_hf)}))"
    )
    assert found["star"] == found["all"]
    assert found["dir_has_all"] and found["dir_has_auto_classes"]


def test_the_auto_class_names_listed_at_import_are_the_classes_built_from_transformers():
    # __all__ is derived from transformers' export table; AUTO_CLASSES from modeling_auto's classes themselves
    listed = sorted(n for n in lowmem_hf.__all__ if n.startswith("LowMemAutoModel") and n != "LowMemAutoModelBase")
    assert listed == sorted(lowmem_hf.AUTO_CLASSES)
    assert all(getattr(lowmem_hf, name) is cls for name, cls in lowmem_hf.AUTO_CLASSES.items())


def test_submodules_stay_reachable_as_attributes_of_the_package():
    found = _fresh("import json\nimport lowmem_hf\nprint(json.dumps(lowmem_hf.load.load.__module__))")
    assert found == "lowmem_hf.load"


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="has no attribute 'LowMemAutoModelForTypo'"):
        lowmem_hf.LowMemAutoModelForTypo  # noqa: B018
