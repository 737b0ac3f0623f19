"""No regression: upstream's own tests against our patched build.

- llama-cpp-python's bundled tests, except those that download models from a hub (listed in
  DOWNLOADS below; this machine has no access to one).
- llama.cpp's test-tiled-mulmat: the upstream test binary that covers CPU MUL_MAT_ID (tiled
  vs vec_dot vs repack kernels). test-backend-ops is not run: it compares every backend with
  the CPU and skips the CPU itself, so on a CPU-only machine it checks nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import LLAMA_CPP_TREE, ROOT, compile_native

PY_TESTS = ROOT / "vendor" / "llama-cpp-python"

# every one of these takes a model from huggingface_hub.hf_hub_download
DOWNLOADS = [
    "test_real_model", "test_real_llama", "test_real_llama_repeated_prompt_cache",
    "test_recurrent_model_prompt_cache_reset", "test_hybrid_model_prompt_cache_reset",
    "test_exact_cached_prompt_reuse_matches_fresh", "test_loaded_exact_cached_prompt_reuse_matches_fresh",
    "test_ram_cache_exact_prompt_hit_matches_fresh", "test_shorter_prompt_prefix_reuse_matches_fresh",
    "test_real_llama_embeddings",
]


def test_llama_cpp_python_bundled_tests():
    expr = " and ".join(f"not {name}" for name in DOWNLOADS)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k", expr],
                         cwd=PY_TESTS, capture_output=True, text=True, timeout=600,
                         env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout


def test_upstream_tiled_mulmat_binary():
    binary = compile_native([LLAMA_CPP_TREE / "tests" / "test-tiled-mulmat.cpp"], "test-tiled-mulmat", cxx=True)
    res = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "FAIL" not in res.stdout
    assert "TEST mul_mat_id" in res.stdout
