"""spac: speculative decoding for MoE models with a device expert pool (see README.md)."""

__version__ = "0.1.0"
