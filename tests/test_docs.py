"""The examples in the public docstrings run and print what they show."""

import doctest

import pytest

import cattention._api
import cattention._kvcache
import cattention._plot


@pytest.mark.parametrize("module", [cattention._api, cattention._kvcache, cattention._plot],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
    if module is cattention._plot:
        pytest.importorskip("matplotlib")
    result = doctest.testmod(module, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0
