"""The expert pool on a real second device: the ggml RPC backend on 127.0.0.1.

A server process exposes its CPU as an RPC device; a client process registers it, so llama.cpp
sees two devices and the pool lives in the server's memory. Uploads go through the device API
(RPC set_tensor), the pool half of every MoE layer is computed by the server. The client runs
in its own process too: a registered RPC device cannot be unregistered, and once its server is
gone every later model load in the process would try to reach it.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from orchestrator.gguf_export import make_random_model
from orchestrator.native import ggml_library
from orchestrator.plan import Plan

from engine_common import PROMPT, model_config, run_sequence

SERVER = textwrap.dedent("""
    import ctypes, sys
    from pathlib import Path
    from llama_cpp import llama_cpp as low
    libdir = Path(low._lib._name).parent
    ggml = ctypes.CDLL(str(libdir / "libggml.so.0"))
    rpc = ctypes.CDLL(str(libdir / "libggml-rpc.so.0"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    cpu = (ctypes.c_void_p * 1)(ggml.ggml_backend_dev_by_type(0))  # GGML_BACKEND_DEVICE_TYPE_CPU
    print("ready", flush=True)
    rpc.ggml_backend_rpc_start_server(sys.argv[1].encode(), None, 1, 1, cpu)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rpc_device():
    """Start the server, register it in this process, return the RPC device's name."""
    endpoint = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, endpoint], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        ggml, rpc = ggml_library("ggml"), ggml_library("ggml-rpc")
        rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
        rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
        ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
        ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        ggml.ggml_backend_dev_name.restype = ctypes.c_char_p
        ggml.ggml_backend_dev_name.argtypes = [ctypes.c_void_p]
        host, port = endpoint.split(":")
        for _ in range(100):  # add_server aborts if nobody listens: wait for the socket first
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        assert reg, "could not reach the RPC server"
        ggml.ggml_backend_register(reg)
        names = [ggml.ggml_backend_dev_name(ggml.ggml_backend_dev_get(i)).decode() for i in range(ggml.ggml_backend_dev_count())]
        rpc_names = [n for n in names if n.startswith("RPC")]
        assert rpc_names, names
        yield rpc_names[0]
    finally:
        proc.kill()
        proc.wait()


def check_pool_on_rpc_device(rpc_device, tmp_path):
    from orchestrator.llm import Context, Model
    from orchestrator.native import ExpertEngine

    path = make_random_model(tmp_path / "m.gguf", model_config("qwen3moe"), seed=2, dtype="f32", quant="q8_0")
    model = Model(path, use_extra_bufts=False)
    ctx = Context(model, n_ctx=64, n_batch=16, n_threads=2)
    try:
        reference = run_sequence(ctx)
        rng = np.random.default_rng(0)
        with ExpertEngine(ctx.ptr, path, device=rpc_device, budget_ratio=0.5) as engine:
            L, E = engine.n_moe_layers, engine.n_expert
            for i in range(10):
                utility = rng.integers(0, 5, (L, E)).astype(np.uint8)
                engine.set_plan(Plan(utility, np.full(L, 2, np.int32)))
                assert engine.wait_idle(60)
                got = run_sequence(ctx)
                np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-4 * np.abs(reference).max())
            stats = engine.stats()
            assert stats["bytes_copied"] > 0 and stats["n_copies"] > 0
            assert stats["n_expert_tokens_device"] > 0
            assert (engine.residency() >= 0).sum() == stats["n_resident"] > 0
        assert len(PROMPT) == 8
    finally:
        ctx.close()
        model.close()


def test_pool_on_rpc_device_matches_feature_off(tmp_path):
    res = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "rpc check passed" in res.stdout


if __name__ == "__main__":
    with rpc_device() as device:
        check_pool_on_rpc_device(device, Path(sys.argv[1]))
    print("rpc check passed")
