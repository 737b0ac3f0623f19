"""Make a self-draft of a MoE GGUF; the same commands as `spac draft` (orchestrator/cli/drafts.py).

    python scripts/make_draft.py quantized target.gguf draft-q4_0.gguf --type q4_0
    python scripts/make_draft.py hot-experts target.gguf draft-hot8.gguf --profile usage.npy --keep 8
"""

from orchestrator.cli.drafts import app

if __name__ == "__main__":
    app()
