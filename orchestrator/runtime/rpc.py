"""ggml's RPC backend, as llama.cpp uses it: serve this machine's device to others, and reach
the devices other machines serve.

    serve("127.0.0.1:50052", n_threads=4)      # blocks; `spac rpc-server`, llama.cpp's rpc-server
    register_servers(["host:50052"])           # `--rpc`: their devices join ggml's list (RPC0, ...)
    with rpc_device() as name: ...             # tests and benches: a server on 127.0.0.1, registered
    with rpc_devices(2) as names: ...          # two of them: two devices (a pool over several)

The protocol has no authentication or encryption: a server must never face an untrusted network.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import subprocess
import sys
import threading
import time

from orchestrator.runtime.native import NativeError, ggml_device_api, ggml_library

WARNING = ("the RPC protocol is not authenticated or encrypted: anyone who reaches this port can "
           "run computations on this machine and read what it holds. Never expose it to an untrusted network.")
_DEVICE_TYPE_CPU, _DEVICE_TYPE_GPU = 0, 1
_registered: dict[str, list[str]] = {}  # endpoint -> its device names, in this process
_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_on_abort = None  # kept alive while ggml holds it


def without_build_paths(text: str) -> str:
    """ggml's message with each source location as file:line, without the directory of the
    machine that compiled it ("/.../ggml/src/ggml-rpc/ggml-rpc.cpp:587" -> "ggml-rpc.cpp:587")."""
    return re.sub(r"(?<![\w.])(?:[A-Za-z]:)?[/\\](?:[^\s:/\\]+[/\\])*([^\s:/\\]+\.(?:c|cc|cpp|h|hpp|cu|m):\d+)", r"\1", text)


def _exit_on_ggml_abort() -> None:
    """ggml's RPC client aborts the process when a server stops answering mid-run: say so in one
    line and exit 2 instead of dying with SIGABRT and a backtrace (a hang is not possible: the
    closed socket is what ggml noticed)."""
    global _on_abort
    if _on_abort is not None:
        return

    @_ABORT_CALLBACK
    def on_abort(message: bytes) -> None:
        text = without_build_paths(message.decode(errors="replace").strip())
        os.write(2, f"spac: error: --rpc: ggml stopped: {text} (did an RPC server stop or lose its network?)\n".encode())
        os._exit(2)

    g = ggml_library("ggml-base")
    g.ggml_set_abort_callback.restype = ctypes.c_void_p
    g.ggml_set_abort_callback.argtypes = [_ABORT_CALLBACK]
    g.ggml_set_abort_callback(on_abort)
    _on_abort = on_abort


def parse_endpoint(text: str) -> tuple[str, int]:
    """"HOST:PORT" → (host, port); ValueError says what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def _device_names(g) -> list[str]:
    return [g.ggml_backend_dev_name(g.ggml_backend_dev_get(i)).decode() for i in range(g.ggml_backend_dev_count())]


def serve(endpoint: str, n_threads: int = 1, device: str | None = None, on_ready=None) -> None:
    """Serve `device` (a ggml name; default: the first GPU, else the CPU) at endpoint until the
    process ends. Ctrl-C raises KeyboardInterrupt here: the server runs on a thread of its own,
    since ggml's accept loop never returns to Python."""
    from llama_cpp import llama_cpp as low  # loads libllama, which registers the backends

    low.llama_backend_init()
    g = ggml_device_api()
    dev = (g.ggml_backend_dev_by_name(device.encode()) if device
           else g.ggml_backend_dev_by_type(_DEVICE_TYPE_GPU) or g.ggml_backend_dev_by_type(_DEVICE_TYPE_CPU))
    if not dev:
        raise NativeError(f"no device {device!r}; ggml sees {', '.join(_device_names(g))}")
    rpc = ggml_library("ggml-rpc")
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    devices = (ctypes.c_void_p * 1)(dev)
    server = threading.Thread(target=rpc.ggml_backend_rpc_start_server, daemon=True,
                              args=(endpoint.encode(), None, n_threads, 1, devices))
    if on_ready is not None:  # before ggml's own lines on stdout; clients wait for the port
        on_ready()
    server.start()
    while server.is_alive():
        server.join(0.2)
    raise NativeError(f"the RPC server at {endpoint} stopped (is the port in use?)")


def register_servers(endpoints, timeout_s: float = 5.0) -> list[str]:
    """Make the devices of RPC servers known to ggml in this process, as llama.cpp's --rpc
    does; their names (RPC0, RPC1, ...) in the order given. NativeError names a server that does
    not answer within timeout_s (ggml itself would abort the process)."""
    g, rpc = ggml_device_api(), ggml_library("ggml-rpc")
    _exit_on_ggml_abort()
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    names = []
    for endpoint in endpoints:
        if endpoint not in _registered:
            host, port = parse_endpoint(endpoint)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.1)).close()
                    break
                except OSError as e:
                    if time.monotonic() >= deadline:
                        raise NativeError(f"no RPC server answers at {endpoint} ({e.strerror or e})") from None
                    time.sleep(0.1)
            before = set(_device_names(g))
            reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
            if not reg:
                raise NativeError(f"the RPC server at {endpoint} offers no device")
            g.ggml_backend_register(reg)
            _registered[endpoint] = [n for n in _device_names(g) if n not in before]
        names += _registered[endpoint]
    return names


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def rpc_devices(n: int = 1, n_threads: int = 1):
    """Start n RPC server processes on 127.0.0.1, each serving its CPU (n_threads threads),
    register them in this process and yield their device names, in order; the servers stop on
    exit.

    A registered RPC device cannot be unregistered: once its server is gone, every later model
    load in this process would try to reach it, so use one process per set of servers."""
    with contextlib.ExitStack() as servers:
        endpoints = []
        for _ in range(n):
            endpoints.append(f"127.0.0.1:{_free_port()}")
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.runtime.rpc", endpoints[-1], str(n_threads), "CPU"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            servers.callback(lambda p=proc: (p.kill(), p.wait()))
            if proc.stdout.readline().strip() != "ready":
                raise NativeError("the RPC server process did not start (is this llama.cpp built with GGML_RPC?)")
        yield register_servers(endpoints, timeout_s=10.0)


@contextlib.contextmanager
def rpc_device(n_threads: int = 1):
    """One server of `rpc_devices`: its device name."""
    with rpc_devices(1, n_threads) as names:
        yield names[0]


if __name__ == "__main__":  # rpc_device's server process: endpoint, threads, device
    with contextlib.suppress(KeyboardInterrupt):
        serve(sys.argv[1], int(sys.argv[2]), sys.argv[3], on_ready=lambda: print("ready", flush=True))
