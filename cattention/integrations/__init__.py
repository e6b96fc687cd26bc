"""Adapters from outside runtimes to cattention, one subpackage per runtime.

Each is imported only when used (``import cattention`` never imports one),
and each imports its runtime itself, so the runtime stays an optional
extra: ``cattention.integrations.transformers`` needs ``pip install
"cattention[transformers]"``.
"""
