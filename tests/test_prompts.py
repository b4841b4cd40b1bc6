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
