"""The examples in the public docstrings and in the user guide run and print
what they show; every public function documents each of its parameters and
gives an example; the built documentation site renders in a browser."""

import doctest
import inspect
import re
import shutil
import subprocess
from pathlib import Path

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


def documented_parameters(doc):
    """Names of the Parameters section's entries that have a description:
    ``name : type`` or ``a, b, c`` lines at the section's indent, followed
    by an indented line."""
    match = re.search(r"^Parameters\n-{10}\n(.*?)(?:^\S[^\n]*\n-{3,}\n|\Z)", doc,
                      re.MULTILINE | re.DOTALL)
    if not match:
        return set()
    lines = match.group(1).splitlines()
    names = set()
    for line, following in zip(lines, lines[1:] + [""]):
        if line and not line[0].isspace() and following.startswith(" "):
            header = line.split(" : ", 1)[0]
            names.update(name.strip().lstrip("*") for name in header.split(","))
    return names


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_every_parameter_is_documented(name):
    function = getattr(cattention, name)
    wanted = set(inspect.signature(function).parameters)
    if not wanted:
        return
    missing = wanted - documented_parameters(inspect.getdoc(function))
    assert not missing, f"{name}: parameters without a description in Parameters: {missing}"


def test_the_parameter_check_sees_a_gap():
    def undocumented(q, k, *, causal=False):
        """Something.

        Parameters
        ----------
        q, k : ndarray
            Queries and keys.

        Returns
        -------
        out : ndarray
            Nothing.
        """
    documented = documented_parameters(inspect.getdoc(undocumented))
    assert documented == {"q", "k"}
    assert set(inspect.signature(undocumented).parameters) - documented == {"causal"}


def test_namespace_holds_only_the_public_api():
    import cattention as ca
    # cython_attention is the public cimport module, integrations the
    # package of the adapters and dask the optional Dask layer: each an
    # attribute once imported
    public = {name for name in vars(ca) if not name.startswith("_")} - {
        "cython_attention", "integrations", "dask"}
    assert public == set(ca.__all__) - {"__version__"}
    assert not hasattr(ca, "np") and not hasattr(ca, "os")


# The user guide's and getting started's ``>>>`` examples; absent when the
# suite runs from a copy outside the source tree (against an installed wheel).
DOCS = Path(__file__).resolve().parent.parent / "docs"
GUIDE_PAGES = sorted(path for path in DOCS.glob("**/*.rst")
                     if "_build" not in path.parts and "auto_examples" not in path.parts
                     and ">>> " in path.read_text(encoding="utf-8"))


@pytest.mark.skipif(not GUIDE_PAGES, reason="no docs/ beside the tests")
@pytest.mark.parametrize("page", GUIDE_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_user_guide_examples(page):
    try:
        result = doctest.testfile(str(page), module_relative=False, raise_on_error=False,
                                  optionflags=doctest.ELLIPSIS, encoding="utf-8")
    finally:
        cattention.set_num_threads(None)
    assert result.attempted > 0
    assert result.failed == 0


# Pages of the built site (make docs) in headless Chromium: the home page,
# a user-guide page and an API page render, not blank.
SITE = DOCS / "_build" / "html"
SCREENSHOT_PAGES = ["index.html", "user-guide/kv-caches.html",
                    "api/generated/cattention.attention.html"]


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.mark.skipif(not (SITE / "index.html").exists(), reason="the site is not built (make docs)")
@pytest.mark.skipif(_chromium() is None, reason="no Chromium")
@pytest.mark.parametrize("page", SCREENSHOT_PAGES)
def test_site_page_renders(page, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    shot = tmp_path / "page.png"
    subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                    "--hide-scrollbars", "--window-size=1280,900", f"--screenshot={shot}",
                    (SITE / page).as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = plt.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (900, 1280)
    # not blank: dark text and more than one colour over much of the page
    dark = (pixels.mean(axis=-1) < 0.5).mean()
    assert 0.005 < dark < 0.6, f"{page}: {dark:.3%} of the pixels dark"
    rows_with_ink = (pixels.std(axis=(1, 2)) > 0.02).mean()
    assert rows_with_ink > 0.2, f"{page}: only {rows_with_ink:.0%} of the rows hold anything"


# The README's Python blocks, in order, in one namespace: they run as shown.
README = DOCS.parent / "README.md"


@pytest.mark.skipif(not README.exists(), reason="no README beside the tests")
def test_readme_examples():
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"),
                        re.MULTILINE | re.DOTALL)
    assert len(blocks) >= 4
    namespace = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    np = namespace["np"]
    assert namespace["out"].shape == namespace["q"].shape[:-1] + (64,)
    assert list(namespace["lengths"]) == [300, 40, 1, 0]
    assert np.allclose(namespace["out"], cattention.attention(namespace["q"], namespace["k"],
                                                              namespace["v"]), atol=1e-5)
