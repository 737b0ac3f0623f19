"""The native side and what sizes it: llama.cpp's model and context (llm.py), spac's expert
engine and its C API (native.py), the host weights' layout (host_layout.py), the unit-cost
calibration (calibrate.py), where the weights go (placement.py) and RPC devices (rpc.py)."""
