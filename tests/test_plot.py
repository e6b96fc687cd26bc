"""plot_scores, the built-in example sentence and ``demo --plot``.

The PNG checks read the file's own header (signature, IHDR chunk and its
CRC, IEND) rather than trusting matplotlib to report what it wrote.
"""

import re
import struct
import subprocess
import sys
import zlib
from importlib import resources

import numpy as np
import pytest

import cattention as ca
from cattention._api import plot as _plot
from cattention.__main__ import main as cli_main

# how plot_scores says that matplotlib is missing, and how to install it
MISSING_MATPLOTLIB_RE = (r'needs matplotlib: pip install matplotlib '
                         r'\(from a cattention source tree: pip install "\.\[plot\]"\)')

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MATPLOTLIB_MODULES = ("matplotlib", "matplotlib.figure", "matplotlib.ticker")


def png_size(path):
    """(width, height) of a PNG file, after checking it is a complete PNG."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, chunk_type = struct.unpack(">I4s", data[8:16])
    assert (length, chunk_type) == (13, b"IHDR")
    (crc,) = struct.unpack(">I", data[29:33])
    assert zlib.crc32(data[12:29]) == crc
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def numpy_softmax_scores(q, k, causal=False):
    logits = (q.astype(np.float64) @ k.astype(np.float64).T) / np.sqrt(q.shape[-1])
    if causal:
        logits = np.where(np.tri(len(q), len(k), dtype=bool), logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in MATPLOTLIB_MODULES:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def head_scores():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 6, 8), dtype=np.float32)
    k = rng.standard_normal((1, 2, 9, 8), dtype=np.float32)
    _, scores = ca.attention(q, k, k, causal=True, return_scores=True)
    return scores[0, 1]


def test_plot_scores_writes_a_valid_png(tmp_path, head_scores):
    pytest.importorskip("matplotlib")
    ax = ca.plot_scores(head_scores, query_labels=list("abcdef"),
                        key_labels=[f"key{j}" for j in range(9)])
    path = tmp_path / "head.png"
    ax.figure.savefig(path)
    width, height = png_size(path)
    assert 200 <= width <= 4000 and 200 <= height <= 4000
    assert path.stat().st_size > 5_000


def test_axes_hold_the_scores_and_the_labels(head_scores):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    queries, keys = list("abcdef"), [f"key{j}" for j in range(9)]
    ax = ca.plot_scores(head_scores, query_labels=queries, key_labels=keys)
    assert isinstance(ax, Axes) and type(ax.figure) is Figure
    assert len(ax.images) == 1
    image = ax.images[0]
    np.testing.assert_array_equal(image.get_array(), head_scores)
    assert image.get_clim() == (0.0, pytest.approx(float(head_scores.max())))
    assert [t.get_text() for t in ax.get_yticklabels()] == queries
    assert [t.get_text() for t in ax.get_xticklabels()] == keys
    assert all(t.get_rotation() != 0 for t in ax.get_xticklabels())
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("key", "query")
    assert len(ax.figure.axes) == 2, "a colour bar beside the heatmap"
    assert image.get_cmap().name == "viridis"


def test_colour_scale_starts_at_zero_unless_values_are_negative():
    pytest.importorskip("matplotlib")
    assert ca.plot_scores(np.full((2, 4), 0.25)).images[0].get_clim() == (0.0, 0.25)
    logits = np.array([[-3.0, 1.0], [0.5, 2.0]])
    assert ca.plot_scores(logits).images[0].get_clim() == (-3.0, 2.0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64, np.bool_])
def test_accepts_numeric_dtypes(dtype):
    pytest.importorskip("matplotlib")
    weights = (np.eye(3, 4) * 0.5 + 0.125).astype(dtype)
    ax = ca.plot_scores(weights)
    np.testing.assert_array_equal(ax.images[0].get_array(), weights.astype(np.float64))


def test_accepts_nested_lists_and_draws_into_a_given_axes():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    fig = Figure()
    left, right = fig.subplots(1, 2)
    assert ca.plot_scores([[1.0, 0.0], [0.25, 0.75]], ax=right) is right
    assert not left.images and len(right.images) == 1
    assert len(fig.axes) == 3, "the two subplots and a colour bar"


def test_figure_size_follows_the_shape_within_bounds():
    pytest.importorskip("matplotlib")
    sizes = [tuple(ca.plot_scores(np.full((t, s), 1.0 / s)).figure.get_size_inches())
             for t, s in [(2, 3), (12, 20), (300, 500), (5000, 100)]]
    small, medium, large, tall = sizes
    assert small[0] < medium[0] < large[0] and small[1] < medium[1] < large[1]
    for width, height in sizes:
        assert 3 <= width <= 16 and 3 <= height <= 12
    assert tall[1] == large[1], "height is capped"


def test_many_labels_show_an_evenly_spaced_subset():
    pytest.importorskip("matplotlib")
    n_queries, n_keys = 300, 500
    keys = [f"k{j}" for j in range(n_keys)]
    weights = np.full((n_queries, n_keys), 1.0 / n_keys)
    ax = ca.plot_scores(weights, query_labels=range(n_queries), key_labels=keys)
    positions = [int(p) for p in ax.get_xticks()]
    shown = [t.get_text() for t in ax.get_xticklabels()]
    assert 2 <= len(shown) <= 40
    assert positions[0] == 0 and positions[-1] == n_keys - 1
    assert shown == [keys[p] for p in positions]
    assert [t.get_text() for t in ax.get_yticklabels()] == [str(int(p)) for p in ax.get_yticks()]


@pytest.mark.parametrize("shape", [(5,), (2, 3, 4), (1, 8, 3, 4), ()])
def test_rejects_arrays_that_are_not_2d(shape):
    with pytest.raises(ValueError, match=rf"2-D .*got shape {re.escape(str(shape))}") as info:
        ca.plot_scores(np.zeros(shape))
    if len(shape) > 2:
        assert "index one head" in str(info.value)


def test_rejects_empty_scores():
    with pytest.raises(ValueError, match=r"empty .*\(4, 0\)"):
        ca.plot_scores(np.zeros((4, 0)))


def test_rejects_label_counts_that_do_not_match():
    weights = np.full((3, 5), 0.2)
    with pytest.raises(ValueError, match=r"query_labels has 2 labels .* 3 query rows"):
        ca.plot_scores(weights, query_labels=["a", "b"])
    with pytest.raises(ValueError, match=r"key_labels has 6 labels .* 5 key columns"):
        ca.plot_scores(weights, key_labels="a b c d e f".split())


@pytest.mark.parametrize("scores", [
    [["a", "b"], ["c", "d"]],
    np.ones((2, 2), dtype=complex),
    np.empty((2, 2), dtype=object),
    None,
], ids=["strings", "complex", "object", "None"])
def test_rejects_non_numeric_scores(scores):
    with pytest.raises(TypeError, match="numeric"):
        ca.plot_scores(scores)


def test_rejects_a_string_or_a_number_as_labels():
    with pytest.raises(TypeError, match="single string"):
        ca.plot_scores(np.eye(3), query_labels="abc")
    with pytest.raises(TypeError, match="sequence of labels"):
        ca.plot_scores(np.eye(3), key_labels=3)


def test_rejects_an_ax_that_is_not_axes():
    pytest.importorskip("matplotlib")
    with pytest.raises(TypeError, match=r"ax must be a matplotlib Axes .*; got int"):
        ca.plot_scores(np.eye(3), ax=5)


def test_missing_matplotlib_is_a_clear_import_error(no_matplotlib):
    with pytest.raises(ImportError, match=MISSING_MATPLOTLIB_RE) as info:
        ca.plot_scores(np.eye(3))
    assert isinstance(info.value.__cause__, ImportError)


def test_import_and_plot_leave_pyplot_alone():
    pytest.importorskip("matplotlib")
    code = (
        "import sys, numpy as np, cattention as ca\n"
        "assert 'matplotlib' not in sys.modules, 'imported eagerly'\n"
        "ca.plot_scores(np.eye(3)).figure.savefig(sys.argv[1])\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code, "/dev/null"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_demo_sentence_is_package_data():
    path = resources.files("cattention") / "data" / "demo_sentence.json"
    assert path.is_file()
    sentence = _plot.load_demo_sentence()
    n_tokens = len(sentence.tokens)
    assert 8 <= n_tokens <= 12
    assert sentence.q.shape == sentence.k.shape == sentence.v.shape
    assert sentence.q.shape[0] == n_tokens and 8 <= sentence.q.shape[1] <= 16
    assert sentence.q.dtype == np.float32
    assert _plot.load_demo_sentence(np.float64).q.dtype == np.float64


@pytest.mark.parametrize("causal", [False, True])
def test_demo_sentence_scores_match_numpy(causal):
    sentence = _plot.load_demo_sentence()
    _, scores = ca.attention(sentence.q, sentence.k, sentence.v, causal=causal,
                             return_scores=True)
    np.testing.assert_allclose(scores.sum(axis=-1), 1.0, rtol=0, atol=1e-6)
    expected = numpy_softmax_scores(sentence.q, sentence.k, causal)
    np.testing.assert_allclose(scores, expected, rtol=0, atol=1e-6)
    if causal:
        assert not np.triu(scores, 1).any()
    tokens = sentence.tokens
    assert tokens[int(scores[tokens.index("it")].argmax())] == "cat"


def run_demo(tmp_path, *extra):
    return subprocess.run([sys.executable, "-m", "cattention", "demo", *extra],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)


@pytest.mark.parametrize("causal", [False, True])
def test_demo_plot_writes_a_valid_png(tmp_path, causal):
    pytest.importorskip("matplotlib")
    path = tmp_path / "attention.png"
    out = run_demo(tmp_path, "--plot", str(path), *(["--causal"] if causal else []))
    assert out.returncode == 0, out.stderr
    assert "the cat sat on the mat because it was tired" in out.stdout
    assert f"causal={causal}" in out.stdout
    it_row = next(line for line in out.stdout.splitlines() if line.startswith("it "))
    assert it_row.split()[1] == "cat"
    assert f"written to {path}" in out.stdout
    width, height = png_size(path)
    assert 200 <= width <= 4000 and 200 <= height <= 4000
    assert path.stat().st_size > 20_000


def test_demo_plot_names_the_file_it_writes(tmp_path, capsys):
    """A path without a suffix gets .png, and the message names that file; an
    empty path is a usage error."""
    pytest.importorskip("matplotlib")
    assert cli_main(["demo", "--plot", str(tmp_path / "weights")]) == 0
    assert f"heatmap written to {tmp_path / 'weights.png'}\n" in capsys.readouterr().out
    assert png_size(tmp_path / "weights.png")[0] >= 200
    assert not (tmp_path / "weights").exists()
    with pytest.raises(SystemExit) as info:
        cli_main(["demo", "--plot", ""])
    assert info.value.code == 2
    assert "--plot needs a file path" in capsys.readouterr().err


def test_demo_plot_without_matplotlib_exits_2(tmp_path, no_matplotlib, capsys):
    path = tmp_path / "attention.png"
    assert cli_main(["demo", "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.search(MISSING_MATPLOTLIB_RE, captured.err)
    assert "Traceback" not in captured.err
    assert not path.exists()


def test_demo_plot_to_an_unwritable_path_is_an_error(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "missing-directory" / "attention.png"
    assert cli_main(["demo", "--plot", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and f"could not write {path}" in captured.err


def test_causal_without_plot_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["demo", "--causal"])
    assert info.value.code == 2
    assert "--causal applies to --plot" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--queries", "0"], ["--dim", "-1"], ["--keys", "x"],
                                  ["--repeats", "0"], ["--heads", "1.5"]])
def test_demo_sizes_must_be_positive_integers(args, capsys):
    from cattention.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {args[0]}: expected a positive integer" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("size", ["100000", "100000000"])
def test_a_demo_workload_beyond_memory_is_a_usage_error(size, capsys):
    from cattention.__main__ import main
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--batch", size, "--heads", size])
    assert exit_info.value.code == 2
    assert "this workload does not fit in memory" in capsys.readouterr().err
