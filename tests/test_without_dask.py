"""cattention imports and works without Dask; cattention.dask says what
to install."""

import subprocess
import sys


def test_cattention_works_without_dask_and_its_dask_layer_names_the_extra():
    code = ("import sys; sys.modules['dask'] = None; sys.modules['distributed'] = None\n"
            "import numpy as np, cattention as ca\n"
            "x = np.ones((2, 3, 4), np.float32)\n"
            "print(ca.attention(x, x, x, causal=True, query_offset=1).dtype)\n"
            "try:\n"
            "    import cattention.dask\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "float32"
    assert "cattention.dask needs Dask" in lines[1] and "'dask' extra" in lines[1]
