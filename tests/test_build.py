"""The build script: patches apply to a fresh extract, re-runs are no-ops, bad sdists are refused."""

from __future__ import annotations

import json
import os
import re
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


def test_the_avx2_variant_has_its_own_isa_flags_build_dir_and_stamp():
    """--cpu-variant avx2 (scripts/test_avx2.sh): -march=native off, AVX2/FMA/F16C on, every
    AVX-512 and AMX option off; a build dir and a stamp of its own, so that building it leaves the
    main build up to date and the other way round (also beside a sanitizer). No build here."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_native as bn

    main = bn.arg_parser().parse_args([])
    avx2 = bn.arg_parser().parse_args(["--cpu-variant", "avx2", "--python", ".venv-avx2/bin/python"])
    flags = bn.cmake_args(avx2)
    assert bn.cmake_args(main) == [a for a in flags if a not in bn.CPU_VARIANTS["avx2"]]
    on = {a[2:-3] for a in flags if a.endswith("=ON")}
    off = {a[2:-4] for a in flags if a.endswith("=OFF")}
    assert {"GGML_AVX2", "GGML_FMA", "GGML_F16C"} <= on and "GGML_NATIVE" in off
    # every AVX-512 and AMX option ggml has, read from its CMakeLists: none left to its default
    text = (ROOT / "vendor" / "llama-cpp-python" / "vendor" / "llama.cpp" / "ggml" / "CMakeLists.txt").read_text()
    isa = set(re.findall(r"option\((GGML_(?:AVX512\w*|AMX_\w+|AVX_VNNI))\b", text))
    assert len(isa) >= 8 and isa <= off, isa - off
    # a --cmake-arg comes after the variant's, so it overrides one of them
    assert bn.cmake_args(bn.arg_parser().parse_args(["--cpu-variant", "avx2", "--cmake-arg=-DGGML_BMI2=OFF"]))[-1] \
        == "-DGGML_BMI2=OFF"
    assert bn.build_dir_of(flags) != bn.build_dir_of(bn.cmake_args(main))
    asan = bn.arg_parser().parse_args(["--sanitize", "address"])
    asan_avx2 = bn.arg_parser().parse_args(["--sanitize", "address", "--cpu-variant", "avx2"])
    stamps = {bn.stamp_path(a) for a in (main, avx2, asan, asan_avx2)}
    assert len(stamps) == 4 and bn.stamp_path(main) == bn.STAMP
    assert bn.stamp_path(avx2) == bn.STAMP.with_name("build-stamp-avx2.json")


def test_stock_programs_follow_the_cpu_variant_of_the_installed_build(tmp_path, monkeypatch):
    """stock_program builds stock llama.cpp for the ISA of the spac build the interpreter imports
    (the real-files tests compare output bytes, which needs the same kernels on both sides): the
    variant is read from the stamp that recorded the installed libllama. No build here."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_native as bn

    lib = tmp_path / "venv" / "libllama.so"
    monkeypatch.setattr(bn, "VENDOR", tmp_path)
    monkeypatch.setattr(bn, "installed_lib", lambda python: lib if python == "variant" else tmp_path / "other.so")
    (tmp_path / "build-stamp.json").write_text(json.dumps({"lib": str(tmp_path / "main.so")}))  # older: no record
    (tmp_path / "build-stamp-avx2.json").write_text(json.dumps({"lib": str(lib), "cpu_variant": "avx2"}))
    assert bn.installed_variant("variant") == "avx2" and bn.installed_variant("main") is None
    calls = []
    monkeypatch.setattr(bn, "installed_variant", lambda python: "avx2")
    monkeypatch.setattr(bn.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, stdout="/x/stock-avx2-0123456789/bin/llama-simple\n", stderr=""))
    assert bn.stock_program("llama-simple") == Path("/x/stock-avx2-0123456789/bin/llama-simple")
    assert calls[0][2:] == ["--stock", "--cpu-variant", "avx2", "--stock-program", "llama-simple"]


def test_a_cpu_variant_needs_the_build_without_it_current(tmp_path, monkeypatch):
    """--cpu-variant copies the base build's package (install_cpu_variant): where that build is not
    current in --base-python, it stops before building anything and names the flag."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_native as bn

    args = bn.arg_parser().parse_args(["--cpu-variant", "avx2", "--base-python", str(tmp_path / "python")])
    monkeypatch.setattr(bn, "up_to_date", lambda *a, **k: False)
    monkeypatch.setattr(bn.subprocess, "run", lambda *a, **k: pytest.fail("built something"))
    with pytest.raises(bn.BuildError, match="--base-python"):
        bn.install_cpu_variant(args, bn.cmake_args(args), bn.read_lock(), bn.read_series())


def test_a_program_for_a_cpu_variant_is_linked_with_its_cpu_backend_only(tmp_path):
    """relink: the stock program's link line in the native build, run there, with the variant's
    libggml-cpu.a in place of the native one and the output in the variant's bin/."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_native as bn

    base, out = tmp_path / "base", tmp_path / "out"
    target_dir = base / "examples" / "simple" / "CMakeFiles" / "llama-simple.dir"
    target_dir.mkdir(parents=True)
    log = tmp_path / "linker-args"
    linker = tmp_path / "c++"
    linker.write_text(f'#!/bin/sh\necho "$PWD" > {log}\necho "$@" >> {log}\n')
    linker.chmod(0o755)
    (target_dir / "link.txt").write_text(f'{linker} -O3 "CMakeFiles/llama-simple.dir/simple.cpp.o" -o ../../bin/'
                                         "llama-simple ../../src/libllama.a ../../ggml/src/libggml.a -ldl "
                                         "../../ggml/src/libggml-cpu.a ../../ggml/src/libggml-base.a -lm\n")
    bn.relink(base, out, "llama-simple")
    cwd, argv = log.read_text().splitlines()
    assert Path(cwd) == base / "examples" / "simple"
    assert argv.split() == ["-O3", "CMakeFiles/llama-simple.dir/simple.cpp.o", "-o", str(out / "bin" / "llama-simple"),
                            "../../src/libllama.a", "../../ggml/src/libggml.a", "-ldl",
                            str(out / "ggml" / "src" / "libggml-cpu.a"), "../../ggml/src/libggml-base.a", "-lm"]
    (target_dir / "link.txt").write_text(f"{linker} x.o -o ../../bin/llama-simple ../../src/libllama.a\n")
    with pytest.raises(bn.BuildError, match="libggml-cpu.a"):
        bn.relink(base, out, "llama-simple")


def _tree_with_native(tmp_path, bn):
    """A stand-in for the extracted sdist (a git repo tagged pristine holding one upstream file)
    and a native/ of two files, placed as a build places them."""
    tree, native = tmp_path / "tree", tmp_path / "native"
    upstream = tree / bn.LLAMA_CPP_DIR / "src" / "llama.cpp"
    upstream.parent.mkdir(parents=True)
    upstream.write_text("upstream\n")
    bn.git("init", "-q", cwd=tree)
    bn.git("add", "-A", cwd=tree)
    bn.git("commit", "-q", "-m", "pristine sdist", cwd=tree)
    bn.git("tag", bn.PRISTINE_TAG, cwd=tree)
    (native / "src").mkdir(parents=True)
    (native / "src" / "own.cpp").write_text("own 1\n")
    (native / "src" / "own.h").write_text("header 1\n")
    (native / "README.md").write_text("not a source file\n")
    bn.place_native(tree, native)
    return tree, native


def test_native_files_are_placed_before_the_patches_and_only_an_edit_recompiles(tmp_path):
    """native/ goes into the tree as one commit (the patches' base); a rebuild rewrites every placed
    file but gives the unchanged ones their old mtime (the CMake build dir recompiles only the
    edited one), and a native edit changes the stamp's key."""
    import build_native as bn

    tree, native = _tree_with_native(tmp_path, bn)
    placed = tree / bn.LLAMA_CPP_DIR / "src"
    assert (placed / "own.cpp").read_text() == "own 1\n" and not (placed / "README.md").exists()
    assert bn.native_files(native) == ["src/own.cpp", "src/own.h"]
    assert bn.git("log", "-1", "--format=%s", bn.NATIVE_TAG, cwd=tree).stdout.startswith("native:")
    lock = {"sha256": "x"}
    key = bn.stamp_key(lock, [], [], "python", native)
    for f in ("own.cpp", "own.h"):
        os.utime(placed / f, (1_000_000, 1_000_000))
    (native / "src" / "own.cpp").write_text("own 2\n")
    before = bn.patched_files(tree)
    bn.git("reset", "-q", "--hard", bn.PRISTINE_TAG, cwd=tree)   # what prepare_tree does
    bn.place_native(tree, native)
    bn.keep_mtimes(tree, before)
    assert (placed / "own.cpp").read_text() == "own 2\n" and (placed / "own.cpp").stat().st_mtime != 1_000_000
    assert (placed / "own.h").stat().st_mtime == 1_000_000
    assert bn.stamp_key(lock, [], [], "python", native) != key


def test_a_native_file_may_not_replace_an_upstream_one(tmp_path):
    import build_native as bn

    tree, native = _tree_with_native(tmp_path, bn)
    (native / "src" / "llama.cpp").write_text("mine\n")
    bn.git("reset", "-q", "--hard", bn.PRISTINE_TAG, cwd=tree)
    with pytest.raises(bn.BuildError, match="native/src/llama.cpp would replace upstream's src/llama.cpp"):
        bn.place_native(tree, native)


def test_export_writes_hooks_as_patches_and_native_edits_back_to_native(tmp_path):
    """--export-patches: a commit's change to an upstream file becomes its patch, its change to one
    of spac's own files is left out of it and copied back to native/; a file edited in both places
    is refused, and neither copy is lost."""
    import build_native as bn

    tree, native = _tree_with_native(tmp_path, bn)
    src = tree / bn.LLAMA_CPP_DIR / "src"
    (src / "llama.cpp").write_text("upstream\nhook\n")
    (src / "own.cpp").write_text("own edited in the tree\n")
    bn.git("commit", "-q", "-am", "0001-hook.patch\n\nllama: a hook", cwd=tree)
    (src / "own.h").write_text("header edited in the tree\n")
    bn.git("commit", "-q", "-am", "0002-own-only.patch", cwd=tree)
    patches = tmp_path / "patches"
    patches.mkdir()
    bn.export_patches(tree, patches, native)
    assert (patches / "series").read_text() == "0001-hook.patch\n"
    text = (patches / "0001-hook.patch").read_text()
    assert text.startswith("llama: a hook\n") and "+hook" in text and "own" not in text
    assert (native / "src" / "own.cpp").read_text() == "own edited in the tree\n"
    assert (native / "src" / "own.h").read_text() == "header edited in the tree\n"
    (native / "src" / "own.h").write_text("header edited in native/\n")
    (src / "own.h").write_text("header edited in the tree again\n")
    with pytest.raises(bn.BuildError, match="native/src/own.h and the tree's copy both changed"):
        bn.export_patches(tree, patches, native)
    assert (native / "src" / "own.h").read_text() == "header edited in native/\n"
