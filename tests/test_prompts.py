"""Prompts: a conversation goes through the chat template like a single user turn does."""

import pytest

from d2o.errors import D2OError
from d2o.runtime.prompts import encode
from d2o.serve.protocol import ChatRequest, CompletionRequest


def test_a_conversation_and_a_single_turn(real_model):
    _, tokenizer = real_model
    single = encode(tokenizer, ["What is 2+2?"], chat=True)
    as_messages = encode(tokenizer, [[{"role": "user", "content": "What is 2+2?"}]], chat=True)
    assert single == as_messages
    longer = encode(tokenizer, [[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is 2+2?"}]], chat=True)[0]
    assert longer != single[0] and tokenizer.decode(longer).count("Be brief.") == 1
    with pytest.raises(D2OError, match="empty"):
        encode(tokenizer, [[{"role": "user", "content": "  "}]], chat=True)
    with pytest.raises(D2OError, match="chat template"):
        encode(tokenizer, [[{"role": "user", "content": "hi"}]], chat=False)


def test_generate_takes_one_conversation_as_one_prompt(real_model):
    from d2o.runtime.generation import generate

    model, tokenizer = real_model
    turn = [{"role": "user", "content": "What is 2+2?"}]
    one = generate(model, tokenizer, turn, "full", 1.0, chat=True, max_new_tokens=4)
    assert one.texts == generate(model, tokenizer, "What is 2+2?", "full", 1.0, chat=True, max_new_tokens=4).texts


def test_a_chat_template_that_refuses_the_messages_is_a_d2o_error(real_model):
    """Mistral's, Llama 2's and Gemma's templates raise on roles that do not alternate: the server
    answers 400 (it turns a D2OError into one), not 500."""
    import copy

    tokenizer = copy.deepcopy(real_model[1])
    tokenizer.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                               "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    assert encode(tokenizer, [[{"role": "user", "content": "hi"}]], chat=True)
    with pytest.raises(D2OError, match="chat template refuses these messages: Conversation roles must alternate"):
        encode(tokenizer, [[{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]], chat=True)


def test_logprobs_off_is_null_for_completions_and_false_for_chat():
    """For completions, logprobs=0 asks for the sampled token's log probability (not built)."""
    from pydantic import ValidationError

    assert CompletionRequest(prompt="x", logprobs=None).logprobs is None
    assert ChatRequest(messages=[{"role": "user", "content": "x"}], logprobs=False).logprobs is False
    with pytest.raises(ValidationError, match="logprobs is not supported"):
        CompletionRequest(prompt="x", logprobs=0)
