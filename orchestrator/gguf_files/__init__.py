"""Model files: GGUF writing and re-quantizing (gguf_export.py), synthetic real-shaped models
(synthetic_models.py), a GGUF's sizes from its header (model_sizes.py), the byte-level BPE
tokenizer the project's own models use (tokenizer.py) and the hot-expert self-draft
(hot_experts.py). It imports nothing else of spac's: the simulator reads sizes through it."""
