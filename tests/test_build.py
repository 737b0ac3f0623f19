"""The build script: patches apply to a fresh extract, re-runs are no-ops, bad sdists are refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, llama_lib_dir

BUILD = ROOT / "scripts" / "build_native.py"
SDIST = ROOT / "vendor" / "downloads" / "llama_cpp_python-0.3.36.tar.gz"
STAMP = ROOT / "vendor" / "build-stamp.json"


def build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILD), *args], capture_output=True, text=True, timeout=600)


def test_series_applies_to_fresh_extract():
    res = build("--check-patches")
    assert res.returncode == 0, res.stderr
    n = len([ln for ln in (ROOT / "ggml-patches" / "series").read_text().splitlines() if ln.strip()])
    assert f"{n} patches apply cleanly to a fresh extract" in res.stdout


def test_failing_patch_names_itself_and_the_file(tmp_path):
    bad = tmp_path / "patches"
    bad.mkdir()
    shutil.copy(ROOT / "ggml-patches" / "0001-ggml-cpu-mul-mat-id-skip-negative-ids.patch", bad)
    text = (ROOT / "ggml-patches" / "0001-ggml-cpu-mul-mat-id-skip-negative-ids.patch").read_text()
    # a context line that upstream does not have: the hunk no longer matches
    broken = text.replace("    std::vector<int32_t> ids;", "    std::vector<int32_t> idz;", 1)
    (bad / "0002-broken.patch").write_text(broken.split("diff --git a/ggml/src/ggml-cpu")[0])
    (bad / "series").write_text("0001-ggml-cpu-mul-mat-id-skip-negative-ids.patch\n0002-broken.patch\n")
    res = build("--check-patches", "--patches-dir", str(bad))
    assert res.returncode == 1
    assert "0002-broken.patch does not apply" in res.stderr
    assert "ggml/src/ggml-backend.cpp" in res.stderr


def test_rebuild_with_nothing_changed_is_a_noop():
    """It did nothing: the stamp says so and the installed library was not written again (no
    wall-time bound, which a loaded machine breaks)."""
    lib = next(llama_lib_dir().glob("libllama.*"))
    before = lib.stat().st_mtime_ns
    res = build()
    assert res.returncode == 0, res.stderr
    assert "up to date" in res.stdout
    assert lib.stat().st_mtime_ns == before


def test_tampered_sdist_is_refused_and_the_build_kept(tmp_path):
    assert SDIST.exists()
    lib = next(llama_lib_dir().glob("libllama.*"))
    before = (lib.stat().st_mtime, STAMP.read_text())
    tampered = tmp_path / SDIST.name
    shutil.copy(SDIST, tampered)
    with open(tampered, "ab") as f:
        f.write(b"\0")
    res = build("--sdist", str(tampered))
    assert res.returncode == 1
    assert "sha256 mismatch" in res.stderr and "refusing to build" in res.stderr
    assert (lib.stat().st_mtime, STAMP.read_text()) == before
    # and the earlier build still counts as up to date
    assert "up to date" in build().stdout


def test_a_patch_description_stops_where_its_diff_starts():
    """The vendor tree's commit message, which --export-patches writes back, is the description
    alone, whichever way the patch's first file starts (0011 and 0012 start with "--- a/")."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_native import PATCHES, patch_description

    for p in (PATCHES / "series").read_text().split():
        text = (PATCHES / p).read_text()
        description = patch_description(text)
        assert description and "\n--- a/" not in description and "diff --git" not in description, p
        assert text.startswith(description)
