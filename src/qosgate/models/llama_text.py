"""llama.cpp's tokenizer and the GGUF's own chat template, for the engine and the embedder."""

from __future__ import annotations

import ctypes
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tokenize(lib: Any, vocab: Any, text: str, *, add_special: bool = True,
             parse_special: bool = True) -> list[int]:
    """Token ids of ``text`` with the model's own tokenizer (what usage counts are based on)."""
    raw = text.encode("utf-8")
    cap = len(raw) + 8
    while True:
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n >= 0:
            return list(buf[:n])
        cap = -n


def token_piece(lib: Any, vocab: Any, token: int) -> bytes:
    """Raw bytes of one token (may be an incomplete UTF-8 sequence); control tokens -> b''."""
    buf = ctypes.create_string_buffer(64)
    n = lib.llama_token_to_piece(vocab, token, buf, 64, 0, False)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = lib.llama_token_to_piece(vocab, token, buf, -n, 0, False)
    return buf.raw[:n]


def _token_text(lib: Any, vocab: Any, token: int) -> str:
    if token < 0:
        return ""
    raw: bytes | None = lib.llama_vocab_get_text(vocab, token)
    return raw.decode("utf-8", errors="replace") if raw else ""


class ChatTemplate:
    """The GGUF's ``tokenizer.chat_template``, compiled once (the way llama-cpp-python's
    Jinja2ChatFormatter sets jinja2 up) on first use."""

    def __init__(self, lib: Any, model: Any, vocab: Any) -> None:
        self._lib = lib
        self._vocab = vocab
        raw: bytes | None = lib.llama_model_chat_template(model, None)
        self.source = raw.decode("utf-8") if raw else None
        self._template: jinja2.Template | None = None

    def _compiled(self) -> jinja2.Template:
        if self.source is None:
            raise ValueError("this model has no tokenizer.chat_template; send a plain prompt")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                loader=jinja2.BaseLoader(),
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols],
            )
            self._template = env.from_string(self.source)
        return self._template

    def render(self, messages: list[dict[str, str]]) -> str:
        """Render ``messages`` (generation prompt on), so the model sees exactly the format it
        was tuned on."""

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        lib, vocab = self._lib, self._vocab
        return self._compiled().render(
            messages=messages,
            bos_token=_token_text(lib, vocab, lib.llama_vocab_bos(vocab)),
            eos_token=_token_text(lib, vocab, lib.llama_vocab_eos(vocab)),
            add_generation_prompt=True,
            raise_exception=raise_exception,
        )
