"""One argument list: ``make_request``'s signature, ``LoadRequest``'s fields, the ``from_pretrained`` docstring and
``docs/arguments.md`` all agree with ``lowmem_hf.arguments.ARGUMENTS``."""

import dataclasses
import inspect
import pydoc

from lowmem_hf import LowMemAutoModelBase, LowMemAutoModelForCausalLM, make_request
from lowmem_hf.arguments import ARGUMENTS, DOCS_PAGE, SECTIONS, arguments_page, from_pretrained_doc
from lowmem_hf.request import LoadRequest, signature_defaults

_STARS = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}


def test_the_table_lists_make_requests_parameters_in_order():
    parameters = list(inspect.signature(make_request).parameters.values())[1:]  # target: the class called on
    assert [a.name for a in ARGUMENTS] == [_STARS.get(p.kind, "") + p.name for p in parameters]


def _fields(cls: type, prefix: str = "") -> set[str]:
    """Dotted names of ``cls``'s fields, a nested dataclass (``hub``, ``tp``) by its own fields."""
    out = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= _fields(type(default), f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


def test_the_table_covers_exactly_the_requests_fields():
    assert {a.field for a in ARGUMENTS if a.field is not None} | {"target"} == _fields(LoadRequest)


def test_every_argument_has_a_section_and_a_doc():
    assert [a.name for a in ARGUMENTS if a.section not in SECTIONS or not a.doc.strip()] == []


def test_help_of_from_pretrained_shows_every_argument_and_the_signature():
    text = pydoc.render_doc(LowMemAutoModelForCausalLM.from_pretrained, renderer=pydoc.plaintext)
    assert LowMemAutoModelBase.from_pretrained.__doc__ == from_pretrained_doc()
    assert [a.name for a in ARGUMENTS if f"{a.name}: " not in text] == []
    shown = inspect.signature(LowMemAutoModelForCausalLM.from_pretrained).parameters.values()
    assert list(shown) == list(inspect.signature(make_request).parameters.values())[1:]
    assert "torch_dtype: 'Any' = None" in text and "**config_overrides" in text


def test_docs_arguments_md_is_what_the_table_writes():
    fix = "run `python -m lowmem_hf.request --write-docs` and commit docs/arguments.md"
    assert DOCS_PAGE.exists(), f"{DOCS_PAGE} is missing: {fix}"
    assert DOCS_PAGE.read_text() == arguments_page(signature_defaults()), f"{DOCS_PAGE} is stale: {fix}"
