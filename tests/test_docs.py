"""The examples in the public docstrings run and print what they show, and
every public function documents its parameters or result with an example."""

import doctest
import inspect
import re

import pytest

import cattention
import cattention._api.dense
import cattention._api.kvcache
import cattention._api.merge
import cattention._api.paged
import cattention._api.plot
import cattention._api.quantize
import cattention._api.threads
import cattention._api.varlen


@pytest.mark.parametrize("module", [cattention, cattention._api.dense, cattention._api.kvcache,
                                    cattention._api.merge, cattention._api.paged,
                                    cattention._api.plot, cattention._api.quantize,
                                    cattention._api.threads, cattention._api.varlen],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
    if module is cattention._api.plot:
        pytest.importorskip("matplotlib")
    result = doctest.testmod(module, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_dask_docstring_examples():
    pytest.importorskip("dask.array", reason="cattention.dask needs dask[array]")
    import cattention.dask
    result = doctest.testmod(cattention.dask, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0


def has_section(doc, title):
    """A NumPy-style section: the title, then a line of dashes under it."""
    return re.search(rf"^\s*{title}\n\s*-{{{len(title)}}}\s*$", doc, re.MULTILINE) is not None


PUBLIC_FUNCTIONS = [name for name in cattention.__all__
                    if inspect.isfunction(getattr(cattention, name))]


def test_all_functions_are_checked():
    # __version__ is the only public name that is not a function
    assert set(cattention.__all__) - set(PUBLIC_FUNCTIONS) == {"__version__"}


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_public_function_docstring(name):
    doc = inspect.getdoc(getattr(cattention, name))
    assert doc, f"{name} has no docstring"
    assert has_section(doc, "Parameters") or has_section(doc, "Returns"), (
        f"{name}: no Parameters or Returns section")
    assert has_section(doc, "Examples"), f"{name}: no Examples section"
    assert ">>> " in doc.split("Examples", 1)[1], f"{name}: Examples has no doctest"


def test_namespace_holds_only_the_public_api():
    import cattention as ca
    # cython_attention (the public cimport module) and dask (the optional
    # Dask layer) are submodules, attributes once imported
    public = {name for name in vars(ca) if not name.startswith("_")} - {"cython_attention",
                                                                         "dask"}
    assert public == set(ca.__all__) - {"__version__"}
    assert not hasattr(ca, "np") and not hasattr(ca, "os")
