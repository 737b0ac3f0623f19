"""Text around the models: the draft/target vocabulary check, the GGUF chat template, and the
stream that turns token bytes into text while holding back what could become a stop string."""

from __future__ import annotations

import codecs
import time
from collections.abc import Sequence

from orchestrator.runtime.llm import Model, ModelError


class VocabMismatchError(ModelError):
    """Target and draft do not share one vocabulary."""


def check_vocab(target: Model, draft: Model) -> None:
    """Raise VocabMismatchError naming the first token id whose text differs."""
    n = min(target.n_vocab, draft.n_vocab)
    for i in range(n):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            raise VocabMismatchError(
                f"draft vocabulary differs from the target's at token {i}: "
                f"target {a!r}, draft {b!r} ({target.path.name} vs {draft.path.name})")
    if target.n_vocab != draft.n_vocab:
        longer, name = (target, "target") if target.n_vocab > draft.n_vocab else (draft, "draft")
        raise VocabMismatchError(
            f"draft vocabulary differs from the target's at token {n}: only the {name} has it "
            f"({longer.token_text(n)!r}); n_vocab target {target.n_vocab}, draft {draft.n_vocab}")


class ChatTemplate:
    """The model's Jinja chat template (GGUF `tokenizer.chat_template`), rendered like HF does."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2 import BaseLoader
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(loader=BaseLoader(), trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = env.from_string(source)

    @classmethod
    def from_model(cls, model: Model) -> ChatTemplate | None:
        source = model.chat_template()
        if source is None:
            return None
        bos, eos = model.bos_token(), model.eos_token()
        return cls(source, model.token_text(bos) if bos >= 0 else "", model.token_text(eos) if eos >= 0 else "")

    def tokens(self, model: Model, messages: list[dict]) -> list[int]:
        """The conversation rendered and tokenized with its special tokens parsed; BOS added
        unless the template already wrote it."""
        text = self.render(messages, add_generation_prompt=True)
        bos = self.bos_token
        return model.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token)


class TextStream:
    """Bytes of token pieces → text, holding back what could still become a stop string."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.text = ""  # everything released so far
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that is now final ("" after a stop)."""
        if self.stopped:
            return ""
        held = self._held + self._decoder.decode(piece)
        if self.stop:
            hits = [i for i in (held.find(s) for s in self.stop) if i >= 0]
            if hits:
                self.stopped = True
                self._held = ""
                return self._release(held[:min(hits)])
            keep = max((_overlap(held, s) for s in self.stop), default=0)
            self._held = held[len(held) - keep:] if keep else ""
            return self._release(held[:len(held) - keep])
        self._held = ""
        return self._release(held)

    def flush(self) -> str:
        if self.stopped:
            return ""
        rest = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return self._release(rest)

    def _release(self, s: str) -> str:
        self.text += s
        return s


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
