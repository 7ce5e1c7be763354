"""Reasoning content, as vLLM's reasoning parsers separate it (`reasoning.parser` in the cluster config).

A reasoning model writes its thinking between <think> and </think>, then the answer. A chat response then carries the
thinking as `reasoning_content` (vLLM's field; the openai SDK exposes it as message.reasoning_content) and the rest as
`content`:

- deepseek_r1 (DeepSeek-R1 and its distills, whose template opens <think> in the prompt): everything before
  </think> is reasoning (a leading <think> left out); no </think> yet means all of it is.
- qwen3 (Qwen3, QwQ): reasoning only between a <think> and a </think>; an output without both is all content (a
  Qwen3 with thinking turned off).

A stream labels each piece once, as it comes (`Stream`): a tag split across deltas is held back until it is whole.

Structured output (and a forced tool call) under a parser shapes the answer alone: the engine's grammar waits for the
</think> token (`after_thinking` in engine/structured.py).
"""
from __future__ import annotations

from engine.structured import THINK_END as END, THINK_START as START

PARSERS = ("none", "deepseek_r1", "qwen3")


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, as vLLM's parsers split it (None: none of it)."""
    if parser == "deepseek_r1":
        head, sep, tail = text.partition(START)
        text = tail if sep else head
        if END not in text:
            return text, None
        reasoning, _, content = text.partition(END)
        return reasoning, content or None
    if parser == "qwen3":
        if START not in text or END not in text:
            return None, text
        reasoning, _, content = text.partition(START)[2].partition(END)
        return reasoning, content or None
    return None, text


def _so_far(parser: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of an output still being written: a qwen3 output inside <think> is reasoning so far."""
    if parser == "qwen3" and START in text and END not in text:
        return text.partition(START)[2], ""
    reasoning, content = split(parser, text)
    return reasoning or "", content or ""


def _partial_tag(text: str) -> int:
    """Characters at the end of text that may begin a tag still to come."""
    for k in range(len(END) - 1, 0, -1):
        if text.endswith(START[:k]) or text.endswith(END[:k]):
            return k
    return 0


class Stream:
    """One choice's output as it streams: step(text so far, finished) -> (reasoning, content) to send now."""

    def __init__(self, parser: str):
        self.parser, self.reasoning, self.content = parser, "", ""

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        safe = text if finished else text[:len(text) - _partial_tag(text)]
        reasoning, content = _so_far(self.parser, safe)
        out_r = reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        out_c = content[len(self.content):] if content.startswith(self.content) else ""
        self.reasoning += out_r
        self.content += out_c
        return out_r, out_c
