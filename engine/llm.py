"""LLM: the offline API — generate over many prompts, chat over one conversation, beam search."""
from __future__ import annotations

from typing import Any, Sequence as Seq

from tqdm import tqdm

from engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams


class LLM:
    """`LLM(model=None, **engine_config)`: knobs use vLLM's names (block_size, max_num_seqs, ...)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a prompt given no SamplingParams samples with: SamplingParams' defaults under the model's generation
        config (engine/generation_config.py), as vLLM's."""
        return self.engine.generation.params()

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Seq[int] | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.
        `lora_request`: an engine.lora.LoRARequest for every prompt, or one (or None: the base) per prompt.

        Every prompt is validated before any is queued, so bad input raises and leaves nothing behind.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or self.get_default_sampling_params()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for t, sp in zip(token_ids, plist):
            sp.validate()
            self.engine.check_prompt(t)
        return self._run(token_ids, loras, use_tqdm, "generate",
                         lambda i, t: self.engine.add_request(t, plist[i], priority=priority[i] if priority else 0,
                                                              lora_request=loras[i]))

    def embed(self, prompts: str | list[int] | Seq[str | list[int]], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False, lora_request=None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's embedding (`out.outputs.embedding`), its final hidden states pooled as
        the model pools them (engine/pooling.py), batched with continuous batching; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        pooling = pooling_params or PoolingParams()
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        pooling.validate(self.engine.hf_config.hidden_size, self.engine.pooling.matryoshka)
        token_ids = [self.engine.tokenize(p) for p in prompts]
        for t in token_ids:
            self.engine.check_prompt(t, pooled=True)
        outs = self._run(token_ids, loras, use_tqdm, "embed",
                         lambda i, t: self.engine.add_request(t, lora_request=loras[i], pooling=pooling))
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding.tolist()),
                                       metrics=o.metrics) for o in outs]

    def _run(self, token_ids: list[list[int]], loras: list, use_tqdm: bool, desc: str, add) -> list[RequestOutput]:
        """Queue every prompt (add(i, ids) -> request id) and step the engine until all finish. Every prompt was
        checked before, so bad input raises and leaves nothing behind; a failure while queueing or stepping
        aborts them all."""
        for lora in {lr for lr in loras if lr is not None}:
            self.engine.load_lora(lora)                    # a bad adapter raises before anything is queued
        ids = []
        try:
            for i, t in enumerate(token_ids):
                ids.append(add(i, t))
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc=desc, disable=not use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [done[r] for r in ids]

    def beam_search(self, prompts: str | list[int] | Seq[str | list[int]], params: BeamSearchParams,
                    lora_request=None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the best `params.beam_width` beams of each prompt (engine/beam_search.py), all
        prompts' beams in each round's batch."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params.validate()
        searches = [BeamSearch(self.engine.tokenize(p), params, self.engine.eos_ids, self.engine.max_model_len)
                    for p in prompts]
        round_params = SamplingParams(max_tokens=1, temperature=params.temperature, ignore_eos=True,
                                      logprobs=searches[0].num_top_logprobs if searches else 0)
        while live := [s for s in searches if not s.done]:
            batch = [(s, p) for s in live for p in s.prompts()]
            outs = self.generate([p for _, p in batch], round_params, lora_request=lora_request)
            for s in live:
                s.advance([o.logprobs[0] for (owner, _), o in zip(batch, outs) if owner is s])
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)      # noqa: E731
        return [s.results(decode) for s in searches]

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None,
             chat_template: str | None = None) -> RequestOutput:
        """Apply the model's chat template (or `chat_template`) to one conversation and generate the reply."""
        return self.generate([self.apply_chat_template(messages, chat_template)], params)[0]

    def apply_chat_template(self, messages: list[dict[str, str]], chat_template: str | None = None) -> list[int]:
        return chat_token_ids(self.tokenizer, messages, chat_template=chat_template)


# what chat_template_kwargs may not set: the arguments chat_token_ids itself gives the template
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "return_tensors",
                                      "chat_template", "padding", "truncation", "max_length", "tokenizer_kwargs"})


def chat_token_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, template_kwargs: dict | None = None,
                   documents: list[dict] | None = None, add_special_tokens: bool = False,
                   chat_template: str | None = None) -> list[int]:
    """The prompt's token ids under the model's chat template, ready for the assistant's turn (vLLM's options:
    without the turn's header, or continuing the last, assistant, message); `tools` (OpenAI's function
    definitions) and `documents` (for retrieval-augmented generation) go to a template that takes them,
    `template_kwargs` are the template's own variables; `add_special_tokens` encodes the rendered text with the
    tokenizer's own special tokens (its BOS) on top of the template's, as vLLM's option does; `chat_template`
    replaces the tokenizer's."""
    from engine.errors import InvalidRequestError
    if not messages:
        raise InvalidRequestError("messages must not be empty")
    if continue_final_message and (add_generation_prompt or messages[-1].get("role") != "assistant"):
        raise InvalidRequestError("continue_final_message needs add_generation_prompt false and an assistant "
                                  "message last")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {}),
             **({"documents": documents} if documents else {}),
             **({"chat_template": chat_template} if chat_template is not None else {})}
    if add_special_tokens:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final_message, **extra)
        return list(tokenizer.encode(text, add_special_tokens=True))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        continue_final_message=continue_final_message, **extra)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
