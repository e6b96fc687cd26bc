"""Sphinx configuration of the cattention documentation (``make docs``).

The API reference is generated from the docstrings (autosummary + numpydoc),
the examples under ``examples/`` run at every build (sphinx-gallery), and
``.. plot::`` blocks in the pages run too (matplotlib's plot directive), so a
change to the library that breaks a documented call breaks the build.
"""

from pathlib import Path

import cattention

DOCS = Path(__file__).resolve().parent

project = "cattention"
author = "the cattention authors"
copyright = "the cattention authors"
release = cattention.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
    "matplotlib.sphinxext.plot_directive",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "examples"]
templates_path = ["_templates"]
html_static_path = ["_static"]

# -- the API reference ------------------------------------------------------
autosummary_generate = True
autodoc_typehints = "none"          # the numpydoc sections carry the types
autodoc_default_options = {"members": False}
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
# The build fails (warnings are errors) when a public docstring documents a
# parameter the signature lacks, omits one it has, or leaves one without a
# description; tests/test_docs.py checks the same without Sphinx.
numpydoc_validation_checks = {"PR01", "PR02", "PR07", "GL08"}

# -- examples and pictures --------------------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": "/plot_",
    "download_all_examples": False,
    "remove_config_comments": True,
    "matplotlib_animations": False,
    # every example must run; a failing one fails the build
    "abort_on_example_error": True,
    "only_warn_on_example_error": False,
    "min_reported_time": 1000,
}

plot_include_source = True
plot_html_show_source_link = False
plot_html_show_formats = False
plot_formats = [("png", 100)]
plot_rcparams = {"figure.autolayout": False}

# -- HTML -------------------------------------------------------------------
html_theme = "pydata_sphinx_theme"
html_title = f"cattention {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_prev_next": True,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_sidebars = {"index": [], "changelog": [], "benchmarks": []}
html_show_sourcelink = False

myst_heading_anchors = 3


# docs/scale-out.md (how a Dask graph grows over machines, with measured
# overheads) ships with cattention.dask; the Dask page lists it when it is
# in the tree, and a toctree naming an absent page would fail the build.
def _list_scale_out(app, docname, source):
    if docname == "user-guide/dask" and (DOCS / "scale-out.md").exists():
        source[0] += "\n\n.. toctree::\n   :maxdepth: 1\n\n   /scale-out\n"


def setup(app):
    app.connect("source-read", _list_scale_out)
