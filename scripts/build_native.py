#!/usr/bin/env python3
"""Build the patched llama.cpp and install it as llama-cpp-python into this Python.

    python scripts/build_native.py            # CPU + RPC (the test build)
    python scripts/build_native.py --cuda --cuda-arch 86
    python scripts/build_native.py --stock    # unpatched llama.cpp's llama-simple + llama-speculative-simple
    python scripts/build_native.py --sanitize address --python .venv-asan/bin/python   # see scripts/sanitize.sh
    python scripts/build_native.py --cpu-variant avx2 --python .venv-avx2/bin/python   # see scripts/test_avx2.sh

Steps: get the sdist pinned in vendor/llama-cpp-python.lock (pip download, sha256 checked),
extract it to vendor/llama-cpp-python/ as a git repo, place spac's own source files (native/,
whose paths are the tree's) in one commit, apply ggml-patches/series (the hooks into upstream's
files) with one commit per patch, then `pip install` the tree with a persistent CMake build dir
so that an edit recompiles only what it touches. A stamp holding a hash of the lock file, the
native files, the patch series and the build options makes a re-run with nothing changed a no-op.

A bad sdist or a patch that does not apply stops the build before anything installed is
touched. Standard library only: this runs before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor"
LOCK = VENDOR / "llama-cpp-python.lock"
IK_LOCK = VENDOR / "ik-llama-cpp-python.lock"  # the host-kernel peer's source (bench/bench_cpu.py)
PATCHES = ROOT / "ggml-patches"
NATIVE = ROOT / "native"                 # spac's own C/C++, laid out as in llama.cpp's tree
TREE = VENDOR / "llama-cpp-python"      # extracted sdist, a git repo
LLAMA_CPP_DIR = "vendor/llama.cpp"       # llama.cpp inside the sdist; patches are relative to it
STAMP = VENDOR / "build-stamp.json"
PRISTINE_TAG = "pristine"
NATIVE_TAG = "spac-native"               # the commit that placed native/, the patches' base
GIT_ID = ["-c", "user.name=spac build", "-c", "user.email=build@spac.invalid", "-c", "commit.gpgsign=false"]

# what the Python package needs; tests, examples, tools and mtmd only cost build time
BASE_CMAKE_ARGS = [
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
]


# --cpu-variant: the host kernels built for a named x86 ISA level instead of -march=native (the
# default build, GGML_NATIVE=ON), e.g. to test on an AVX-512 machine the kernels an AVX2-only
# desktop runs. avx2 is ggml's own `haswell` variant (GGML_CPU_ALL_VARIANTS): AVX2, FMA, F16C and
# BMI2 on, every AVX-512 and AMX option off (and AVX-VNNI, which Alder Lake has beside AVX2).
CPU_VARIANTS = {
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
             "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
}


class BuildError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[build] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_lock(path: Path = LOCK) -> dict:
    """The lock file's `key = "value"` lines (a TOML subset: tomllib is 3.11+, this runs on 3.10)."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = (part.strip() for part in line.partition("="))
        if not sep or len(value) < 2 or value[0] != '"' or value[-1] != '"':
            raise BuildError(f"{path.name}:{n}: expected key = \"value\", got {line!r}")
        out[key] = value[1:-1]
    return out


def read_series(patch_dir: Path = PATCHES) -> list[Path]:
    series = patch_dir / "series"
    if not series.exists():
        return []
    names = [ln.strip() for ln in series.read_text().splitlines()]
    patches = [patch_dir / n for n in names if n and not n.startswith("#")]
    for p in patches:
        if not p.exists():
            raise BuildError(f"{patch_dir.name}/series names {p.name}, which does not exist")
    return patches


def cmake_args(args: argparse.Namespace) -> list[str]:
    """CMake arguments of this build; with --cuda this may install cuBLAS (see cuda_args)."""
    out = list(BASE_CMAKE_ARGS)
    if args.rpc:
        out.append("-DGGML_RPC=ON")
    if args.sanitize:
        # ggml's and llama's own options; OpenMP's runtime is not instrumented (TSan would report
        # its barriers), so a sanitized build uses ggml's own thread pool
        flag = args.sanitize.upper()
        out += [f"-DGGML_SANITIZE_{flag}=ON", f"-DLLAMA_SANITIZE_{flag}=ON", "-DGGML_OPENMP=OFF",
                "-DCMAKE_BUILD_TYPE=RelWithDebInfo"]
    if args.cpu_variant:
        out += CPU_VARIANTS[args.cpu_variant]
    if args.cuda:
        # "native" would need a GPU at build time; an explicit list builds anywhere nvcc exists
        out += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={args.cuda_arch}", *cuda_args(args.python)]
    out += args.cmake_arg
    return out


def cuda_args(python: str) -> list[str]:
    """What a CUDA build needs beyond nvcc, found or provided; a BuildError names what to install.

    cuBLAS: from the toolkit, else from PyPI's nvidia-cublas wheel (installed into `python`),
    whose libraries lack the unversioned .so links the linker looks for: links to them go in
    vendor/build/cuda-shim, and the wheel's lib folder becomes a run path of the built libraries.
    The driver library (libcuda.so) exists only where an NVIDIA driver is installed: without it
    ggml's virtual-memory pool, the one user of the driver API, is left out (GGML_CUDA_NO_VMM).
    """
    nvcc = _find_nvcc()
    root = nvcc.parent.parent
    lib_dirs = [root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"]
    out = [f"-DCMAKE_CUDA_COMPILER={Path(nvcc).resolve()}"]
    if not any((d / "libcublas.so").exists() for d in lib_dirs):
        out += _cublas_from_wheel(python, _cuda_major(nvcc))
    driver = any((d / name).exists() for d in lib_dirs for name in ("libcuda.so", "stubs/libcuda.so"))
    if not driver and "libcuda.so" not in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout:
        log("no libcuda.so here (no NVIDIA driver): building with -DGGML_CUDA_NO_VMM=ON")
        out.append("-DGGML_CUDA_NO_VMM=ON")
    return out


def _find_nvcc() -> Path:
    """The toolkit's own nvcc (a wrapper script on PATH does not tell where the toolkit is)."""
    candidates = [os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    for root in filter(None, candidates):
        if (Path(root) / "bin" / "nvcc").exists():
            return (Path(root) / "bin" / "nvcc").resolve()
    on_path = shutil.which("nvcc")
    if on_path is None:
        raise BuildError("--cuda needs nvcc: install the CUDA toolkit (NVIDIA's cuda-toolkit package) "
                         "and set CUDA_PATH to it or put its bin/ on PATH")
    return Path(on_path).resolve()


def _cuda_major(nvcc: Path) -> int:
    res = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    found = re.search(r"release (\d+)\.", res.stdout)
    if found:
        return int(found.group(1))
    raise BuildError(f"cannot read the CUDA version from `{nvcc} --version`:\n{res.stdout}{res.stderr}")


def _cublas_from_wheel(python: str, major: int) -> list[str]:
    package = "nvidia-cublas" if major >= 13 else f"nvidia-cublas-cu{major}"
    find = ("import glob, os, sysconfig; d = os.path.join(sysconfig.get_paths()['purelib'], 'nvidia'); "
            "print(*sorted(glob.glob(d + '/**/libcublas.so.*', recursive=True)), sep='\\n')")

    def wheel_libs() -> list[str]:
        res = subprocess.run([python, "-c", find], capture_output=True, text=True)
        return [ln for ln in res.stdout.split() if ln]

    if not wheel_libs():
        log(f"cuBLAS is not in the CUDA toolkit: installing PyPI's {package} into {python}")
        res = subprocess.run([python, "-m", "pip", "install", "-q", package], capture_output=True, text=True)
        if res.returncode != 0 or not wheel_libs():
            raise BuildError(f"cuBLAS not found: install the toolkit's cuBLAS (libcublas-dev) or `pip install {package}`\n"
                             f"{res.stderr[-1500:]}")
    lib_dir = Path(wheel_libs()[0]).parent
    include = lib_dir.parent / "include"
    if not (include / "cublas_v2.h").exists():
        raise BuildError(f"{package} has no include/cublas_v2.h next to {lib_dir}: reinstall it, or install libcublas-dev")
    shim = VENDOR / "build" / "cuda-shim"
    shim.mkdir(parents=True, exist_ok=True)
    out = []
    for name in ("cublas", "cublasLt"):
        (versioned,) = sorted(lib_dir.glob(f"lib{name}.so.*"))[:1] or [None]
        if versioned is None:
            raise BuildError(f"{package} has no lib{name}.so.* in {lib_dir}")
        link = shim / f"lib{name}.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(versioned)
        out.append(f"-DCUDA_{name}_LIBRARY={link}")
    return out + [f"-DCMAKE_CUDA_FLAGS=-I{include}", f"-DCMAKE_CXX_FLAGS_INIT=-I{include}",
                  f"-DCMAKE_SHARED_LINKER_FLAGS=-Wl,-rpath,{lib_dir}"]


def no_amx_args() -> list[str]:
    """Unpatched, ggml-cpu's AMX matmul crashes when GCC 12 builds it at -O3 (patch 0011 says
    why; upstream issue 20824) and gives wrong results with batch dims (patch 0012), so the stock
    build turns the AMX instructions off explicitly (-march=native would compile them in)."""
    if not _cpu_has_amx():
        return []
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]


def _cpu_has_amx() -> bool:
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def native_files(native: Path = NATIVE) -> list[str]:
    """spac's own source files: their paths in llama.cpp's tree (native/'s README is not one)."""
    return sorted(str(f.relative_to(native)) for f in native.rglob("*")
                  if f.is_file() and f.name != "README.md")


def stamp_key(lock: dict, patches: list[Path], cmake: list[str], python: str, native: Path = NATIVE) -> str:
    h = hashlib.sha256()
    h.update(LOCK.read_bytes())
    for rel in native_files(native):
        h.update(rel.encode())
        h.update((native / rel).read_bytes())
    for p in patches:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(json.dumps([cmake, python]).encode())
    return h.hexdigest()


def installed_lib(python: str) -> Path | None:
    """libllama.so of the llama_cpp that `python` imports, found without loading it."""
    code = ("import importlib.util as u; s = u.find_spec('llama_cpp'); "
            "print(s.submodule_search_locations[0] if s else '')")
    res = subprocess.run([python, "-c", code], capture_output=True, text=True)
    pkg = res.stdout.strip()
    if res.returncode != 0 or not pkg:
        return None
    libs = sorted(Path(pkg, "lib").glob("libllama.*"))
    return libs[0] if libs else None


def installed_variant(python: str) -> str | None:
    """The --cpu-variant of the build whose libllama `python` imports (its stamp's record), None
    for the native build or one that no stamp names (e.g. a copied package)."""
    lib = installed_lib(python)
    for stamp_file in sorted(VENDOR.glob("build-stamp*.json")) if lib else []:
        try:
            stamp = json.loads(stamp_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if stamp.get("lib") == str(lib):
            return stamp.get("cpu_variant")
    return None


def stamp_path(args: argparse.Namespace) -> Path:
    """One stamp per sanitizer and CPU variant (and pair of them), so that building one does not
    make the others stale."""
    variant = "-".join(filter(None, (args.sanitize, args.cpu_variant)))
    return STAMP.with_name(f"build-stamp-{variant}.json") if variant else STAMP


def up_to_date(key: str, python: str, stamp_file: Path = STAMP, cpu_variant: str | None = None) -> bool:
    """The stamp holds this key, the installed library is the one it recorded, and it records the
    CPU variant (which stock_program reads; a stamp written before it did is rewritten)."""
    if not stamp_file.exists():
        return False
    try:
        stamp = json.loads(stamp_file.read_text())
    except json.JSONDecodeError:
        return False
    lib = installed_lib(python)
    return (stamp.get("key") == key and lib is not None
            and stamp.get("lib") == str(lib) and stamp.get("lib_mtime") == lib.stat().st_mtime
            and stamp.get("cpu_variant") == cpu_variant)


def fetch_sdist(lock: dict, python: str, sdist: Path | None, lock_file: Path = LOCK) -> Path:
    """Return a verified copy of the pinned sdist; raise before touching anything on mismatch."""
    cached = VENDOR / "downloads" / lock["filename"]
    if sdist is None and not cached.exists():
        log(f"downloading {lock['name']}=={lock['version']} (sdist) with pip")
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--no-build-isolation", "-d", tmp, f"{lock['name']}=={lock['version']}"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            got = list(Path(tmp).glob("*.tar.gz"))
            if res.returncode != 0 or not got:
                raise BuildError(f"pip download failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
            digest = sha256_file(got[0])
            if digest != lock["sha256"]:
                raise BuildError(_hash_message(got[0].name, lock, digest, lock_file))
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(got[0], cached)
        return cached
    path = sdist or cached
    if not path.exists():
        raise BuildError(f"sdist {path} does not exist")
    digest = sha256_file(path)
    if digest != lock["sha256"]:
        raise BuildError(_hash_message(str(path), lock, digest, lock_file))
    return path


def _hash_message(name: str, lock: dict, digest: str, lock_file: Path) -> str:
    return (f"sha256 mismatch for {name}:\n  expected {lock['sha256']} (vendor/{lock_file.name})\n"
            f"  got      {digest}\nrefusing to build from it; the earlier build is left in place")


def git(*args: str, cwd: Path = TREE, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["git", *GIT_ID, *args], cwd=cwd, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {cwd}:\n{res.stderr}")
    return res


def prepare_tree(sdist: Path, sha: str, tree: Path = TREE) -> None:
    """Extract the sdist once into a git repo tagged `pristine`; later runs reset to the tag.

    Resetting (instead of re-extracting) keeps the mtime of every file no patch touches, so
    the persistent CMake build dir recompiles only what changed.
    """
    marker = tree / ".spac-sdist-sha256"
    if tree.exists() and marker.exists() and marker.read_text().strip() == sha:
        git("reset", "-q", "--hard", PRISTINE_TAG, cwd=tree)
        git("clean", "-q", "-fdx", cwd=tree)
        return
    _extract(sdist, sha, tree)


def patched_files(tree: Path) -> dict[str, tuple[str, float]]:
    """Files the placed native files and the applied patches make or touch: path -> (content hash, mtime)."""
    if not (tree / ".git").exists():
        return {}
    out = {}
    for rel in git("diff", "--name-only", PRISTINE_TAG, cwd=tree).stdout.split():
        f = tree / rel
        if f.is_file():
            out[rel] = (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime)
    return out


def keep_mtimes(tree: Path, before: dict[str, tuple[str, float]]) -> None:
    """Give re-patched files whose content did not change their old mtime, so the build
    does not recompile them."""
    for rel, (digest, mtime) in before.items():
        f = tree / rel
        if f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() == digest:
            os.utime(f, (mtime, mtime))


def _extract(sdist: Path, sha: str, tree: Path) -> None:
    log(f"extracting {sdist.name}")
    tree.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=tree.parent, prefix=".extract-"))
    try:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        (top,) = list(tmp.iterdir())
        # the sdist ships upstream's .git, where vendor/llama.cpp is a submodule link: start a
        # fresh repo so every file of the tree is tracked and patches show up in `git diff`
        shutil.rmtree(top / ".git", ignore_errors=True)
        (top / ".spac-sdist-sha256").write_text(sha + "\n")
        git("init", "-q", cwd=top)
        git("add", "-A", "--force", cwd=top)  # upstream .gitignore files would hide src/models/
        git("commit", "-q", "-m", "pristine sdist", cwd=top)
        git("tag", PRISTINE_TAG, cwd=top)
        if tree.exists():
            shutil.rmtree(tree)
        top.rename(tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# upstream programs the stock build makes: llama-simple (the load check), the speculative
# decoding loop a llama.cpp user already has (the peer of spac's loop in bench/bench_live.py),
# llama-bench and llama-quantize (the CPU-kernel peer and its files, bench/bench_cpu.py)
STOCK_TARGETS = ("llama-simple", "llama-speculative-simple", "llama-bench", "llama-quantize")


def stock_program(name: str) -> Path:
    """The path of one of STOCK_TARGETS, built first where needed by `build_native.py --stock` in
    a process of its own (the build's output stays out of the caller's); for the benchmarks,
    scripts and tests that run stock llama.cpp beside spac. Built for the ISA of the spac build this
    interpreter imports: where that is a --cpu-variant (scripts/test_avx2.sh), so is stock's
    program, which is then built alone (the comparison of output bytes needs the same kernels on
    both sides; the whole set would cost minutes more of CI)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stock"]
    variant = installed_variant(sys.executable)
    if variant:
        cmd += ["--cpu-variant", variant, "--stock-program", name]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the stock build failed:\n{res.stderr[-3000:]}")
    return Path(res.stdout.strip().splitlines()[-1]).parent / name


def build_stock(lock: dict, python: str, sdist: Path | None, variant: str | None = None,
                targets: tuple[str, ...] = STOCK_TARGETS) -> Path:
    """Build upstream's STOCK_TARGETS (or `targets` of them) from the pinned sdist with no patch
    applied: the proof that the GGUF files spac writes load in stock llama.cpp, and the peers
    spac's benchmarks measure against; -march=native, or a --cpu-variant's ISA level. Cached under
    vendor/build/stock[-<variant>]-<key>; returns the first target's path (the others are beside it)."""
    cmake = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF",
             *(CPU_VARIANTS[variant] if variant else no_amx_args())]
    if variant is None:
        return _build_programs(lock, LOCK, python, sdist, "stock", LLAMA_CPP_DIR, targets, cmake)
    # a variant changes only ggml's CPU backend (as install_cpu_variant says): that is built, and the
    # programs are linked again with it from the native build's objects
    base = build_stock(lock, python, sdist, None, targets).parent.parent
    if not (base / "src" / "libllama.a").exists():  # built before the sources moved out of src/
        shutil.rmtree(base)
        base = build_stock(lock, python, sdist, None, targets).parent.parent
    return _build_programs(lock, LOCK, python, sdist, f"stock-{variant}", LLAMA_CPP_DIR, targets, cmake,
                           relink_from=base)


def build_ik(python: str, variant: str | None = None) -> Path:
    """Build ik_llama.cpp's llama-bench from the sdist pinned in IK_LOCK, as its users build it
    (Release, -march=native, its own CPU kernels on), or for a --cpu-variant's ISA level (its CMake
    options are ggml's): the host-kernel peer of bench/bench_cpu.py. Cached under
    vendor/build/ik[-<variant>]-<key>; returns llama-bench's path."""
    isa = ["-DLLAMA_CURL=OFF", *CPU_VARIANTS[variant]] if variant else ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", *no_amx_args()]
    cmake = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
             "-DLLAMA_BUILD_SERVER=OFF", *isa]
    lock = read_lock(IK_LOCK)

    def build_info(tree: Path) -> None:
        # the sdist lacks the CMake script that writes common/build-info.cpp from git: write it here
        # (newer than its template, so the build does not try to)
        common = tree / "common"
        text = (common / "build-info.cpp.in").read_text()
        for key, value in (("BUILD_NUMBER", "0"), ("BUILD_COMMIT", f"sdist-{lock['version']}"),
                           ("BUILD_COMPILER", "cc"), ("BUILD_TARGET", "native")):
            text = text.replace(f"@{key}@", value)
        (common / "build-info.cpp").write_text(text)

    return _build_programs(lock, IK_LOCK, python, None, f"ik-{variant}" if variant else "ik", "vendor/ik_llama.cpp",
                           ("llama-bench",), cmake, prepare=build_info)


def _build_programs(lock: dict, lock_file: Path, python: str, sdist: Path | None, name: str, source_dir: str,
                    targets: tuple[str, ...], cmake: list[str], prepare=None, relink_from: Path | None = None) -> Path:
    """CMake `targets` of the tree at `source_dir` inside the locked sdist into
    vendor/build/<name>-<key> (key: the sdist's hash and the CMake arguments); the first target's path.
    relink_from: a build of the same tree whose `targets` differ from these only in ggml's CPU
    backend: only that library is built here, and each target is linked as it was there, with it."""
    key = hashlib.sha256(json.dumps([lock["sha256"], cmake]).encode()).hexdigest()[:10]
    out = VENDOR / "build" / f"{name}-{key}"
    exe = out / "bin" / targets[0]
    if all((out / "bin" / t).exists() for t in targets):
        return exe
    targets = tuple(t for t in targets if not (out / "bin" / t).exists())  # a later call's other program
    sdist = fetch_sdist(lock, python, sdist, lock_file)
    src = out / "sdist"  # not src/: CMake builds llama.cpp's src/ (libllama) there
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    log(f"building {lock['name']}'s {', '.join(targets)} in {out.relative_to(ROOT)}")
    with tarfile.open(sdist) as tf:
        tf.extractall(src, filter="data")
    (top,) = list(src.iterdir())
    if prepare is not None:
        prepare(top / source_dir)
    cmake_build(top / source_dir, out, cmake, ("ggml-cpu",) if relink_from else targets)
    for target in targets if relink_from else ():
        relink(relink_from, out, target)
    shutil.rmtree(src, ignore_errors=True)
    missing = [t for t in targets if not (out / "bin" / t).exists()]
    if missing:
        raise BuildError(f"the {name} build produced no {', '.join(missing)} in {out / 'bin'}")
    return exe


def cmake_build(source: Path, out: Path, cmake: list[str], targets: tuple[str, ...]) -> None:
    """Configure `source` into `out` with `cmake` and build `targets` there."""
    for cmd in (["cmake", "-S", str(source), "-B", str(out), *cmake],
                ["cmake", "--build", str(out), "--target", *targets, "-j", str(os.cpu_count() or 1)]):
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"{' '.join(cmd[:2])} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")


def relink(base: Path, out: Path, target: str) -> None:
    """Link the static program `target` into out/bin with CMake's link line in the build `base`,
    every library but ggml's CPU backend from there, out's CPU backend instead of base's."""
    (link,) = base.glob(f"**/CMakeFiles/{target}.dir/link.txt")
    cmd = shlex.split(link.read_text())
    cmd[cmd.index("-o") + 1] = str(out / "bin" / target)
    cpu = [i for i, arg in enumerate(cmd) if arg.endswith("/libggml-cpu.a")]
    if len(cpu) != 1:
        raise BuildError(f"{link} does not link libggml-cpu.a once: {target} cannot be linked for a CPU variant")
    cmd[cpu[0]] = str(out / "ggml" / "src" / "libggml-cpu.a")
    (out / "bin").mkdir(parents=True, exist_ok=True)
    res = subprocess.run(cmd, cwd=link.parent.parent.parent, capture_output=True, text=True)  # the target's dir
    if res.returncode != 0:
        raise BuildError(f"linking {target} for a CPU variant failed:\n{res.stderr[-3000:]}")


def ik_program(name: str = "llama-bench") -> Path:
    """ik_llama.cpp's llama-bench, built first where needed by `build_native.py --ik` in a process
    of its own, for the ISA of the spac build this interpreter imports (as stock_program)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--ik"]
    variant = installed_variant(sys.executable)
    if variant:
        cmd += ["--cpu-variant", variant]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the ik_llama.cpp build failed:\n{res.stderr[-3000:]}")
    return Path(res.stdout.strip().splitlines()[-1]).parent / name


def patch_description(text: str) -> str:
    """What a patch says before its diff (its first file may start "diff --git" or "--- a/"):
    the commit message in the vendor tree, written back by --export-patches."""
    return re.split(r"^(?:diff --git |--- a/)", text, maxsplit=1, flags=re.M)[0].strip()


def place_native(tree: Path = TREE, native: Path = NATIVE) -> None:
    """Copy spac's own files into the pristine tree as one commit, tagged NATIVE_TAG: the patches
    apply on top of it (they add the hooks that build and call these files)."""
    for rel in native_files(native):
        dst = tree / LLAMA_CPP_DIR / rel
        if git("cat-file", "-e", f"{PRISTINE_TAG}:{LLAMA_CPP_DIR}/{rel}", cwd=tree, check=False).returncode == 0:
            raise BuildError(f"native/{rel} would replace upstream's {rel}: spac's own files must be new files "
                             "(change an upstream file with a patch)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(native / rel, dst)
    git("add", "-A", "--force", cwd=tree)
    git("commit", "-q", "--allow-empty", "-m", "native: spac's own source files (native/)", cwd=tree)
    git("tag", "-f", NATIVE_TAG, cwd=tree)


def apply_patches(patches: list[Path], tree: Path = TREE) -> None:
    """`git apply --check`, then apply and commit, every patch in order.

    A failure names the patch and git's message names the file and hunk.
    """
    for p in patches:
        res = git("apply", "--check", f"--directory={LLAMA_CPP_DIR}", str(p), cwd=tree, check=False)
        if res.returncode != 0:
            raise BuildError(f"{p.parent.name}/{p.name} does not apply to the pinned tree:\n{res.stderr.strip()}")
        # later patches build on earlier ones, so apply before checking the next
        git("apply", f"--directory={LLAMA_CPP_DIR}", str(p), cwd=tree)
        git("add", "-A", "--force", cwd=tree)
        header = patch_description(p.read_text())
        git("commit", "-q", "--allow-empty", "-m", f"{p.name}\n\n{header}".strip(), cwd=tree)


def export_patches(tree: Path = TREE, patches_dir: Path = PATCHES, native: Path = NATIVE) -> None:
    """Write each commit after the placed native files back to ggml-patches/<commit subject>, and
    a native file edited in the tree back to native/.

    The patch workflow: build once, edit in vendor/llama-cpp-python/vendor/llama.cpp, amend or
    add commits there (subject = patch file name, body = the patch's description), then run
    with --export-patches. spac's own files are best edited in native/ (the next build places
    them); one edited in the tree instead is copied back, unless native/ changed too (refused:
    neither copy is lost).
    """
    own = native_files(native)
    for rel in own:
        placed = git("show", f"{NATIVE_TAG}:{LLAMA_CPP_DIR}/{rel}", cwd=tree).stdout
        in_tree = (tree / LLAMA_CPP_DIR / rel).read_text()
        if in_tree == placed:
            continue
        if (native / rel).read_text() not in (placed, in_tree):
            raise BuildError(f"native/{rel} and the tree's copy both changed since the last build: "
                             "keep one of them (edit native/ and build again, or copy the tree's over)")
        (native / rel).write_text(in_tree)
        log(f"native/{rel}: the tree's edit copied back")
    not_own = [f":(exclude){LLAMA_CPP_DIR}/{rel}" for rel in own]
    revs = git("rev-list", "--reverse", f"{NATIVE_TAG}..HEAD", cwd=tree).stdout.split()
    names = []
    for rev in revs:
        name = git("log", "-1", "--format=%s", rev, cwd=tree).stdout.strip()
        header = git("log", "-1", "--format=%b", rev, cwd=tree).stdout.strip()
        diff = git("diff", f"--relative={LLAMA_CPP_DIR}", f"{rev}~1", rev, "--", ".", *not_own, cwd=tree).stdout
        if not diff:
            log(f"{name} changes only spac's own files: no patch written")
            continue
        (patches_dir / name).write_text((header + "\n\n" if header else "") + diff)
        names.append(name)
    (patches_dir / "series").write_text("".join(n + "\n" for n in names))
    log(f"exported {len(names)} patches to {patches_dir.name}/")


def build_dir_of(cmake: list[str]) -> Path:
    """One build dir per option set, so that a CUDA build never reuses a CPU cache."""
    return VENDOR / "build" / hashlib.sha256(json.dumps(cmake).encode()).hexdigest()[:10]


def configure(cmake: list[str]) -> None:
    out = build_dir_of(cmake).with_name(build_dir_of(cmake).name + "-configure")
    cmd = ["cmake", "-S", str(TREE / LLAMA_CPP_DIR), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", *cmake]
    log(f"configuring in {out.relative_to(ROOT)}")
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise BuildError(f"CMake configure failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    log(f"configure passed in {time.monotonic() - t0:.0f} s")


def pip_install(python: str, cmake: list[str]) -> None:
    build_dir = build_dir_of(cmake)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(shlex.quote(a) for a in cmake)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    res = subprocess.run([python, "-c", "import scikit_build_core"], capture_output=True)
    if res.returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", "scikit-build-core>=0.9.2"], check=True)
    # a local path is always rebuilt and reinstalled by pip; its runtime deps come along
    cmd = [python, "-m", "pip", "install", "--no-build-isolation",
           "-C", f"build-dir={build_dir}", str(TREE)]
    log(f"building with CMAKE_ARGS={env['CMAKE_ARGS']} (log: {build_dir}.log)")
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{build_dir}.log", "w") as logf:
        res = subprocess.run(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        tail = Path(f"{build_dir}.log").read_text().splitlines()[-40:]
        raise BuildError("pip install of the patched tree failed:\n" + "\n".join(tail))


def install_cpu_variant(args: argparse.Namespace, cmake: list[str], lock: dict, patches: list[Path]) -> None:
    """--cpu-variant: GGML_NATIVE and the ISA options reach only ggml's CPU backend (every other
    target compiles with the same flags either way), so a variant is the base build's installed
    package with its libggml-cpu.so compiled for the variant's ISA. Only that target is built
    (about a minute on 2 cores, against ten for the whole tree); libllama and the rest are the
    base build's, byte for byte. The base: the same build options without the variant, installed
    in --base-python and current (scripts/install.sh)."""
    base_args = argparse.Namespace(**{**vars(args), "cpu_variant": None})
    base_key = stamp_key(lock, patches, cmake_args(base_args), args.base_python)
    if not up_to_date(base_key, args.base_python, stamp_path(base_args)):
        raise BuildError(f"the build without --cpu-variant is not current in {args.base_python} "
                         "(--base-python): build it first (scripts/install.sh)")
    base_pkg = installed_lib(args.base_python).parent.parent
    out = build_dir_of(cmake).with_name(build_dir_of(cmake).name + "-cpu")  # not a wheel's build dir
    log(f"building ggml's CPU backend for --cpu-variant {args.cpu_variant} in {out.relative_to(ROOT)}")
    cmake_build(TREE, out, ["-DCMAKE_BUILD_TYPE=Release", *cmake], ("ggml-cpu",))
    (cpu_lib,) = out.glob("bin/libggml-cpu.so")
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    dst = Path(subprocess.run([args.python, "-c", code], capture_output=True, text=True, check=True).stdout.strip())
    for item in [base_pkg, *base_pkg.parent.glob("llama_cpp_python-*.dist-info")]:
        shutil.rmtree(dst / item.name, ignore_errors=True)
        shutil.copytree(item, dst / item.name, symlinks=True)
    for lib in (dst / "llama_cpp" / "lib").glob("libggml-cpu.so*"):
        lib.unlink()
        shutil.copy2(cpu_lib.resolve(), lib)


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="interpreter to install into (default: this one)")
    ap.add_argument("--cuda", action="store_true", help="build the CUDA backend (needs nvcc)")
    ap.add_argument("--cuda-arch", default="75;86;89",
                    help="CMAKE_CUDA_ARCHITECTURES (default: Turing, Ampere and Ada consumer GPUs)")
    ap.add_argument("--no-rpc", dest="rpc", action="store_false",
                    help="leave out the RPC backend (the tests use it as their second device)")
    ap.add_argument("--sanitize", choices=["address", "thread"],
                    help="build with AddressSanitizer or ThreadSanitizer (own build dir and stamp; install it "
                         "into its own venv with --python, see scripts/sanitize.sh)")
    ap.add_argument("--cpu-variant", choices=sorted(CPU_VARIANTS),
                    help="build the host kernels for this ISA level instead of -march=native (avx2: an "
                         "AVX2-only desktop's; own build dir and stamp; install it into its own venv with "
                         "--python, see scripts/test_avx2.sh)")
    ap.add_argument("--base-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="with --cpu-variant: the interpreter where the build without it is installed, "
                         "whose package the variant copies (default: .venv's)")
    ap.add_argument("--configure-only", action="store_true",
                    help="patch the tree and run CMake's configure step into the build dir, then stop "
                         "(checks a --cuda setup on a machine where the full compile would take hours)")
    ap.add_argument("--cmake-arg", action="append", default=[], help="extra CMake argument (repeatable)")
    ap.add_argument("--sdist", type=Path, help="use this sdist file instead of downloading")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp says up to date")
    ap.add_argument("--check-patches", action="store_true",
                    help="only check that the series applies to a fresh extract (in a temp dir), then stop")
    ap.add_argument("--stock", action="store_true",
                    help="build unpatched llama.cpp's llama-simple, llama-speculative-simple, llama-bench and "
                         "llama-quantize (cached under vendor/build/) and print llama-simple's path")
    ap.add_argument("--stock-program", choices=STOCK_TARGETS,
                    help="with --stock: build this one program only (default: all four)")
    ap.add_argument("--ik", action="store_true",
                    help="build ik_llama.cpp's llama-bench (vendor/ik-llama-cpp-python.lock; cached under "
                         "vendor/build/; for --cpu-variant's ISA if given), the host-kernel peer of "
                         "bench/bench_cpu.py, and print its path")
    ap.add_argument("--patches-dir", type=Path, default=PATCHES, help=argparse.SUPPRESS)
    ap.add_argument("--export-patches", action="store_true",
                    help="write the commits of vendor/llama-cpp-python back to ggml-patches/")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = arg_parser().parse_args(argv)

    t0 = time.monotonic()
    try:
        if args.export_patches:
            export_patches(patches_dir=args.patches_dir)
            return 0
        if args.ik:
            print(build_ik(args.python, args.cpu_variant))
            return 0
        lock = read_lock()
        if args.stock:
            targets = (args.stock_program,) if args.stock_program else STOCK_TARGETS
            print(build_stock(lock, args.python, args.sdist, args.cpu_variant, targets))
            return 0
        patches = read_series(args.patches_dir)
        if args.check_patches:
            sdist = fetch_sdist(lock, args.python, args.sdist)
            with tempfile.TemporaryDirectory() as tmp:
                prepare_tree(sdist, lock["sha256"], Path(tmp) / "tree")
                place_native(Path(tmp) / "tree")
                apply_patches(patches, Path(tmp) / "tree")
            log(f"{len(native_files())} native files placed, {len(patches)} patches apply cleanly to a fresh extract")
            return 0
        cmake = cmake_args(args)
        key = stamp_key(lock, patches, cmake, args.python)
        if not (args.force or args.sdist) and up_to_date(key, args.python, stamp_path(args), args.cpu_variant):
            log(f"up to date ({len(patches)} patches), nothing to do")
            return 0
        if args.cpu_variant and not (args.sanitize or args.configure_only):
            # the tree as the current base build left it: preparing it again would clean out what
            # that build installed into it (llama_cpp/lib, which upstream's Python tests load)
            install_cpu_variant(args, cmake, lock, patches)
        else:
            sdist = fetch_sdist(lock, args.python, args.sdist)
            before = patched_files(TREE)
            prepare_tree(sdist, lock["sha256"])
            place_native()
            apply_patches(patches)
            keep_mtimes(TREE, before)
            log(f"{len(patches)} patches apply cleanly")
            if args.configure_only:
                configure(cmake)
                return 0
            pip_install(args.python, cmake)
        lib = installed_lib(args.python)
        if lib is None:
            raise BuildError("llama_cpp is not importable after install")
        stamp_path(args).write_text(json.dumps({"key": key, "lib": str(lib), "lib_mtime": lib.stat().st_mtime,
                                                "cpu_variant": args.cpu_variant}) + "\n")
        log(f"done in {time.monotonic() - t0:.0f} s")
        return 0
    except BuildError as e:
        print(f"[build] error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
