"""Data files shipped with cattention, read with ``importlib.resources``.

``demo_sentence.json``: the built-in example sentence of
``python -m cattention demo --plot`` (see ``cattention._plot.load_demo_sentence``).
"""
