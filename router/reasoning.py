"""Reasoning content, as vLLM's reasoning parsers separate it (`reasoning.parser` in the cluster config).

A reasoning model writes its thinking between <think> and </think>, then the answer. A chat response then carries the
thinking as `reasoning_content` (vLLM's field; the openai SDK exposes it as message.reasoning_content) and the rest as
`content`:

- deepseek_r1 (DeepSeek-R1 and its distills, whose template opens <think> in the prompt): everything before
  </think> is reasoning (a leading <think> left out); no </think> yet means all of it is.
- qwen3 (Qwen3, QwQ): reasoning only between a <think> and a </think>; an output without both is all content (a
  Qwen3 with thinking turned off).
- gpt_oss (gpt-oss's harmony format, vLLM's openai_gptoss): the output is messages, each `<|channel|>NAME ...
  <|message|>BODY` and an end (<|end|>, <|return|>, <|call|>), the next after `<|start|>assistant`. The `analysis`
  channel's bodies are reasoning, the `final` channel's the content; a `commentary` message to a function
  (`to=functions.NAME`) is a tool call, kept in the content in one canonical form (CALL_OPEN ...) for router/tools.py's
  `harmony` parser; one to no one (a preamble) is content. Special tokens' text is kept for it (the markers are
  special tokens).

A stream labels each piece once, as it comes (`Stream`): a tag split across deltas is held back until it is whole.

Structured output (and a forced tool call) under a parser shapes the answer alone: the engine's grammar waits for the
</think> token (`after_thinking` in engine/structured.py).
"""
from __future__ import annotations

import re

from engine.structured import THINK_END as END, THINK_START as START

PARSERS = ("none", "deepseek_r1", "qwen3", "gpt_oss")
H_START, H_MESSAGE, H_ENDS = "<|start|>", "<|message|>", ("<|end|>", "<|return|>", "<|call|>")
CALL_OPEN, CALL_END = "<|channel|>commentary to=functions.", "<|call|>"     # a tool call in split()'s content
_H_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def harmony_messages(text: str) -> list[tuple[str, str | None, str, bool]]:
    """(channel, recipient, body, ended) of each message of a harmony output whose body has begun."""
    out = []
    for part in text.split(H_START):
        header, sep, body = part.partition(H_MESSAGE)
        if not sep:
            continue
        ends = [body.find(e) for e in H_ENDS if e in body]
        if ends:
            body = body[:min(ends)]
        channel, recipient = _H_CHANNEL.search(header), _H_RECIPIENT.search(header)
        out.append((channel.group(1) if channel else "final", recipient.group(1) if recipient else None, body,
                    bool(ends)))
    return out


def _split_harmony(text: str) -> tuple[str | None, str | None]:
    if H_MESSAGE not in text:            # a message's header still coming (nothing to show yet), or not harmony
        return (None, None) if text.lstrip().startswith("<|") else (None, text or None)
    reasoning, content = [], []
    for channel, recipient, body, ended in harmony_messages(text):
        if channel == "analysis":
            reasoning.append(body)
        elif recipient is not None and recipient.startswith("functions."):
            content.append(f"{CALL_OPEN}{recipient.removeprefix('functions.')}{H_MESSAGE}{body}"
                           f"{CALL_END if ended else ''}")
        else:
            content.append(body)
    return "".join(reasoning) if reasoning else None, "".join(content) if content else None


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output, as vLLM's parsers split it (None: none of it)."""
    if parser == "gpt_oss":
        return _split_harmony(text)
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


def _partial_tag(text: str, parser: str = "") -> int:
    """Characters at the end of text that may begin a tag still to come (harmony: a special token's text, <|...|>)."""
    if parser == "gpt_oss":
        at = text.rfind("<")
        return len(text) - at if at >= 0 and "|>" not in text[at:] and "<|".startswith(text[at:at + 2]) else 0
    for k in range(len(END) - 1, 0, -1):
        if text.endswith(START[:k]) or text.endswith(END[:k]):
            return k
    return 0


class Stream:
    """One choice's output as it streams: step(text so far, finished) -> (reasoning, content) to send now."""

    def __init__(self, parser: str):
        self.parser, self.reasoning, self.content = parser, "", ""

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        safe = text if finished else text[:len(text) - _partial_tag(text, self.parser)]
        reasoning, content = _so_far(self.parser, safe)
        out_r = reasoning[len(self.reasoning):] if reasoning.startswith(self.reasoning) else ""
        out_c = content[len(self.content):] if content.startswith(self.content) else ""
        self.reasoning += out_r
        self.content += out_c
        return out_r, out_c
