"""Types: mypy --strict accepts a typed caller (tools/typed_example.py) and
rejects misuse, and the stub of the compiled module names exactly what the
module defines."""

import ast
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import cattention
from cattention._native import driver as _attention

# the repository root, or wherever the suite was copied to run against an
# installed wheel; the package itself is always the imported one
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = Path(__file__).resolve().parent.parent / "tools" / "typed_example.py"
PACKAGE = Path(cattention.__file__).resolve().parent


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    # shared by this module's runs: a cold run spends seconds on NumPy's stubs
    return tmp_path_factory.mktemp("mypy-cache")


def run_mypy(cache_dir, *args):
    """mypy from the directory above tests/: in a source checkout it reads the
    package there and pyproject.toml's [tool.mypy]; elsewhere the installed
    package, through its py.typed."""
    pytest.importorskip("mypy")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_typed_example_passes_strict(mypy_cache):
    result = run_mypy(mypy_cache, "--strict", str(EXAMPLE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_configured_package_check_passes(mypy_cache):
    # plain `mypy` checks what pyproject.toml lists: the package and the example
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("not a source checkout: no pyproject.toml with the mypy configuration")
    result = run_mypy(mypy_cache)
    assert result.returncode == 0, result.stdout + result.stderr


def test_typed_example_runs():
    result = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


# Each line is one misuse and the fragments its mypy error must contain; the
# annotated assignments show that results are not Any.
MISUSES = [
    ('ca.attention(q, q, q, causal="yes")',
     ('No overload variant of "attention" matches', '"str"')),
    ('ca.attention_scores(q, q, causal="yes")',
     ('Argument "causal" to "attention_scores"', 'incompatible type "str"')),
    ("threads: str = ca.get_num_threads()",
     ('expression has type "int", variable has type "str"',)),
    ("ca.set_num_threads(2.5)", ('"set_num_threads" has incompatible type "float"',)),
    ("ca.attention_scores(q, q, return_scores=True)",
     ('Unexpected keyword argument "return_scores"',)),
    ("pair: tuple[NDArray[Any], NDArray[Any]] = ca.attention(q, q, q)",
     ("Incompatible types in assignment",)),
    ("single: NDArray[Any] = ca.attention(q, q, q, return_lse=True)",
     ("Incompatible types in assignment",)),
    ("ca.merge(q, q).shape", ('"tuple[', 'has no attribute "shape"')),
    ("ca._native.driver.set_simd(1)", ('"set_simd" has incompatible type "int"',)),
]


def test_misuse_is_rejected(mypy_cache, tmp_path):
    header = textwrap.dedent("""\
        from typing import Any

        import numpy as np
        from numpy.typing import NDArray

        import cattention as ca

        q = np.ones((2, 4), dtype=np.float32)
    """)
    snippet = tmp_path / "misuse.py"
    first_line = header.count("\n") + 1
    snippet.write_text(header + "".join(code + "\n" for code, _ in MISUSES))
    result = run_mypy(mypy_cache, "--strict", str(snippet))
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    for offset, (code, fragments) in enumerate(MISUSES):
        errors = [line for line in output.splitlines()
                  if line.startswith(f"{snippet}:{first_line + offset}: error:")]
        assert any(all(f in line for f in fragments) for line in errors), (
            f"no error containing {fragments} for {code!r}:\n{output}")


def stub_names():
    """Names the stub gives the compiled module (functions, constants)."""
    tree = ast.parse((PACKAGE / "_driver" / "extension.pyi").read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {name for name in names if not name.startswith("_")}


def runtime_names():
    """Public names the compiled module defines (not the modules it imports)."""
    return {name for name, value in vars(_attention).items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType)}


def test_stub_covers_compiled_module():
    missing = runtime_names() - stub_names()
    assert not missing, f"extension.pyi lacks {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(stub_names()))
def test_stub_name_exists_at_runtime(name):
    assert hasattr(_attention, name), f"extension.pyi declares {name}, the module lacks it"


def test_typing_files_ship_with_the_package():
    package = Path(cattention.__file__).parent
    assert (package / "py.typed").is_file()
    assert (package / "_driver" / "extension.pyi").is_file()
