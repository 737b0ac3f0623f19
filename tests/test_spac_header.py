"""spac's own native files (native/: the pool, the C API and its header, the exact kernels) are
the ones the installed build compiled: each equals its copy in the built tree, so a native edit
that was not built fails here, not as a mismatch elsewhere. native.py's ctypes structs are held to
native/include/spac.h's structs (size and every field's offset, measured by the C compiler), so
that neither side can gain a field alone."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
from build_native import NATIVE, native_files  # scripts/ is on pytest's pythonpath
from conftest import LLAMA_CPP_TREE, compile_native

from orchestrator.runtime.native import SpacDiskStats, SpacEngineParams, SpacEngineStats, SpacMissCosts

STRUCTS = {"spac_engine_params": SpacEngineParams, "spac_engine_stats": SpacEngineStats,
           "spac_disk_stats": SpacDiskStats, "spac_miss_costs": SpacMissCosts}


def test_native_holds_the_pool_the_api_and_the_exact_kernels():
    assert {"include/spac.h", "src/spac.cpp", "src/llama-expert-pool.cpp", "src/llama-expert-pool.h",
            "ggml/src/ggml-cpu/exact.cpp", "ggml/src/ggml-cpu/exact.h"} <= set(native_files())


@pytest.mark.parametrize("rel", native_files())
def test_every_native_file_is_the_built_one(rel):
    assert (NATIVE / rel).read_text() == (LLAMA_CPP_TREE / rel).read_text(), \
        f"native/{rel} differs from the built tree's: run scripts/build_native.py"


def c_layout(tmp_path) -> dict[str, int]:
    """sizeof of each struct and offsetof of each field that ctypes declares, as C sees them."""
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "spac.h"', "int main(void) {"]
    for name, cls in STRUCTS.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof(struct {name}));')
        for field, *_ in cls._fields_:
            lines.append(f'    printf("{name}.{field} %zu\\n", offsetof(struct {name}, {field}));')
    lines += ["    return 0;", "}"]
    src = tmp_path / "spac_layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = compile_native([src], "spac-layout", libs=("llama",), extra=(f"-I{NATIVE / 'include'}",))
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_the_ctypes_structs_match_the_header(tmp_path):
    c = c_layout(tmp_path)
    for name, cls in STRUCTS.items():
        assert ctypes.sizeof(cls) == c[name], f"struct {name}: {ctypes.sizeof(cls)} bytes in native.py, {c[name]} in spac.h"
        for field, *_ in cls._fields_:
            assert getattr(cls, field).offset == c[f"{name}.{field}"], f"{name}.{field}"
