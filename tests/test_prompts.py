"""Prompts: a conversation goes through the chat template like a single user turn does."""

import pytest

from d2o.errors import D2OError
from d2o.runtime.prompts import encode


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
