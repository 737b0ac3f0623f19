"""include/spac.h, the C API the patch series adds (patches 0002, 0003, 0005, 0008, 0009, 0010,
0016, 0018, 0020 each add to it), is readable in the repository as one file; this pins it to
the header the patched tree builds, and orchestrator/runtime/native.py's ctypes structs to its structs
(size and every field's offset, measured by the C compiler), so that neither side can gain a
field alone."""

from __future__ import annotations

import ctypes
import subprocess

from conftest import LLAMA_CPP_TREE, ROOT, compile_native

from orchestrator.runtime.native import SpacEngineParams, SpacEngineStats

STRUCTS = {"spac_engine_params": SpacEngineParams, "spac_engine_stats": SpacEngineStats}


def test_the_repository_header_is_the_built_one():
    built = (LLAMA_CPP_TREE / "include" / "spac.h").read_text()
    assert (ROOT / "include" / "spac.h").read_text() == built, \
        "include/spac.h differs from the patched tree's: copy it after changing a patch (cp vendor/llama-cpp-python/vendor/llama.cpp/include/spac.h include/)"


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
    exe = compile_native([src], "spac-layout", libs=("llama",), extra=(f"-I{ROOT / 'include'}",))
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_the_ctypes_structs_match_the_header(tmp_path):
    c = c_layout(tmp_path)
    for name, cls in STRUCTS.items():
        assert ctypes.sizeof(cls) == c[name], f"struct {name}: {ctypes.sizeof(cls)} bytes in native.py, {c[name]} in spac.h"
        for field, *_ in cls._fields_:
            assert getattr(cls, field).offset == c[f"{name}.{field}"], f"{name}.{field}"
