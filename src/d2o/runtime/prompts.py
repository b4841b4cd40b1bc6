"""Prompts in, token ids out: chat templates, the model's limits and its stop tokens.

Nothing here changes the caller's tokenizer (batches are padded by the decoding path), and
nothing here needs torch, so input can be checked before it loads.
"""

from __future__ import annotations

from jinja2 import TemplateError

from d2o.errors import D2OError


def chat_text(tokenizer, prompt: str | list[dict]) -> str | None:
    """``prompt`` in the tokenizer's chat template, ready for the answer: a user turn, or a whole
    conversation (``[{"role": ..., "content": ...}, ...]``); None if the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except TemplateError as error:  # the template refuses the conversation (e.g. roles that do not alternate)
        raise D2OError(f"the model's chat template refuses these messages: {error}") from None


def as_list(prompts: str | list[dict] | list[str | list[dict]]) -> list[str | list[dict]]:
    """Prompts as a list: a text or a conversation (a list of messages) is one prompt, a list of
    them is several."""
    one = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], dict))
    return [prompts] if one else list(prompts)


def encode(tokenizer, prompts: list[str | list[dict]], chat: bool = False) -> list[list[int]]:
    """The token ids of each prompt; through the chat template if asked (its text then carries
    the special tokens). With ``chat``, a prompt may be a conversation (a list of messages)."""
    if not prompts or any(not _words(p).strip() for p in prompts):
        raise D2OError("the prompt is empty")
    if chat:
        templated = [chat_text(tokenizer, p) for p in prompts]
        if templated[0] is None:
            raise D2OError("this model's tokenizer has no chat template: drop --chat")
        prompts = templated
    elif not all(isinstance(p, str) for p in prompts):
        raise D2OError("a conversation (a list of messages) needs the chat template (chat=True)")
    return [tokenizer(p, add_special_tokens=not chat).input_ids for p in prompts]


def _words(prompt: str | list[dict]) -> str:
    return prompt if isinstance(prompt, str) else "".join(str(turn.get("content") or "") for turn in prompt)


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """The tokens that end an answer: the tokenizer's end of sequence and the model's (its
    generation config may name several), and the pad token."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids += [tokenizer.eos_token_id, tokenizer.pad_token_id]
    return frozenset(i for i in ids if i is not None)


def positions(model) -> int | None:
    """The positions the model (or its config) has (None: its config does not say)."""
    return getattr(getattr(model, "config", model).get_text_config(), "max_position_embeddings", None)


def check_length(model, n_tokens: int, max_new_tokens: int = 0) -> None:
    """Refuse a prompt the model has no positions for, saying by how much."""
    limit = positions(model)
    if limit is not None and n_tokens + max_new_tokens > limit:
        over = n_tokens + max_new_tokens - limit
        raise D2OError(
            f"prompt too long for the model: {n_tokens} tokens + {max_new_tokens} new need "
            f"{n_tokens + max_new_tokens} positions, the model has {limit} ({over} too many)"
        )
