"""
Speed beside the peers
======================

GFLOP/s of full and causal attention (float32, 8 heads of d = 64, one
thread) against the sequence length, for cattention and the peers the
benchmark times in the same process: PyTorch's
``scaled_dot_product_attention``, onnxruntime's Attention operator,
OpenVINO's ScaledDotProductAttention and plain NumPy. The figures are the
stored output of a short run of the benchmark,

.. code-block:: sh

   python benchmarks/attention.py --threads 1 --rounds 7 --no-memory \\
       --json docs/_static/bench.json --cases "1x8x1024x1024x64 full float32,\\
   1x8x1024x1024x64 causal float32,1x8x2048x2048x64 full float32,\\
   1x8x2048x2048x64 causal float32,1x4x4096x4096x64 causal float32"

read back here; the machine it ran on is printed below the code. Full tables
for several machines, and how to reproduce them: :doc:`../benchmarks`.
"""

import json
from pathlib import Path

import matplotlib.pyplot as plt

# sphinx-gallery runs this file from its own directory; the stored run is
# docs/_static/bench.json
try:
    here = Path(__file__).resolve().parent
except NameError:                       # run line by line in a console
    here = Path.cwd()
run = json.loads((here.parent / "_static" / "bench.json").read_text())

config = run["config"]
simd = {r["simd"] for r in run["records"] if r.get("simd")}
print(f"{config['cpu']}, {config['cpu_count']} CPUs; kernel table {', '.join(sorted(simd))}; "
      f"threads {run['settings']['threads']}")
print(f"Python {config['python']}, NumPy {config['numpy']}, PyTorch {config['torch']}, "
      f"BLAS {config['blas']}")
busy = run.get("background_cores")
if busy:
    print(f"other processes kept {busy:.2f} cores busy on average during the run")

# %%
# One line per implementation; cattention's is drawn heavier.

records = [r for r in run["records"]
           if r["kind"] == "attention" and r["dtype"] == "float32" and r["gflops"]
           and r["shape"][2] == r["shape"][3] and r["shape"][4] == 64]
impls = list(dict.fromkeys(r["impl"] for r in records))

fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True, layout="constrained")
for ax, causal in zip(axes, (False, True)):
    for color, impl in enumerate(impls):
        points = sorted((r["shape"][2], r["gflops"]) for r in records
                        if r["impl"] == impl and r["causal"] == causal)
        if points:
            lengths, rates = zip(*points)
            ax.plot(lengths, rates, marker="o", color=f"C{color}", label=impl,
                    linewidth=3 if impl == "cattention" else 1.3)
    ax.set_xscale("log", base=2)
    shown = sorted({r["shape"][2] for r in records if r["causal"] == causal})
    ax.set_xticks(shown, [str(n) for n in shown])
    ax.set_xlabel("sequence length T = S")
    ax.set_title("causal" if causal else "full")
    ax.grid(True, alpha=0.3)
axes[0].set_ylabel("GFLOP/s (float32, 1 thread)")
axes[1].legend(fontsize=8)
plt.show()

# %%
# The same run as ratios: peer time / cattention time (above 1: cattention
# is faster).

for r in records:
    if r["impl"] != "cattention" and r.get("vs_ca"):
        print(f"{r['case']:<26} {r['impl']:<15} {r['vs_ca']:.2f}x")
