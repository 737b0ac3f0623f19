"""Shared fixtures: where the patched build lives, and compiling small native tests against it."""

from __future__ import annotations

import hashlib
import importlib.util
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_TREE = ROOT / "vendor" / "llama-cpp-python" / "vendor" / "llama.cpp"
NATIVE_BUILD = ROOT / "build" / "tests"


def pytest_configure(config):
    # a run started in the background of a non-interactive shell inherits SIGINT ignored, and so
    # would every CLI the tests start: the Ctrl-C tests need Python's default handler
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def llama_lib_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None:
        pytest.fail("llama_cpp is not installed: run scripts/build_native.py first")
    return Path(spec.submodule_search_locations[0]) / "lib"


def _build_id(library: Path) -> str:
    """The ELF build id (binutils' readelf), "" where there is none or no readelf."""
    try:
        out = subprocess.run(["readelf", "-n", str(library)], capture_output=True, text=True).stdout
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if "Build ID" in line), "")


def llama_common_dir() -> Path | None:
    """bin/ of the build that made the installed libllama (the same ELF build id), where llama.cpp's
    common library is; else the newest build's, None without one. Not simply the newest: that may
    be a sanitizer build (scripts/sanitize.sh), whose libraries need its runtime preloaded."""
    builds = sorted(ROOT.glob("vendor/build/*/bin/libllama-common.so.0"), key=lambda p: p.stat().st_mtime)
    installed = _build_id(llama_lib_dir() / "libllama.so")
    same = [p for p in builds if installed and _build_id(p.parent / "libllama.so") == installed]
    return (same or builds)[-1].parent if builds else None


def compile_native(sources: list[Path], name: str, cxx: bool = False, libs=("ggml", "ggml-base", "ggml-cpu"),
                   extra=()) -> Path:
    """Compile a test program against the installed patched libraries; cached by content."""
    lib_dir = llama_lib_dir()
    key = hashlib.sha256(b"".join(s.read_bytes() for s in sources) + str(lib_dir).encode()
                         + str(extra).encode()).hexdigest()[:12]
    out = NATIVE_BUILD / f"{name}-{key}"
    if out.exists():
        return out
    NATIVE_BUILD.mkdir(parents=True, exist_ok=True)
    compiler = ["g++", "-std=c++17"] if cxx else ["gcc", "-std=c11"]
    cmd = [*compiler, "-O2", "-Wall", *map(str, sources), "-o", str(out),
           f"-I{LLAMA_CPP_TREE / 'ggml' / 'include'}", f"-I{LLAMA_CPP_TREE / 'include'}", *extra,
           f"-L{lib_dir}", *(f"-l{lib}" for lib in libs), f"-Wl,-rpath,{lib_dir}", "-lm", "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"compiling {name} failed:\n{res.stderr}")
    return out
