"""The examples in the public docstrings run and print what they show."""

import doctest

import cattention._api


def test_api_docstring_examples():
    result = doctest.testmod(cattention._api, raise_on_error=False)
    assert result.attempted > 0
    assert result.failed == 0
