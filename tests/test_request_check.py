"""model.check_request, the one check of a request's lengths shared by the Engine, the peers and the server;
and what model.encode_prompt refuses."""

from __future__ import annotations

import pytest

from entmtp.errors import PromptError
from entmtp.model import check_request, encode_prompt


def test_a_request_that_fits_passes_and_each_bad_length_is_named_with_its_fix():
    check_request(100, 412, 512)  # exactly fills the window
    with pytest.raises(PromptError, match="the prompt is empty"):
        check_request(0, 10, 512)
    with pytest.raises(PromptError, match="max_new_tokens must be >= 1, got 0"):
        check_request(10, 0, 512)
    with pytest.raises(PromptError, match="use max_new_tokens <= 412"):
        check_request(100, 413, 512)


def test_the_prompt_is_checked_before_the_generation_length():
    # the server's default limit is what the window leaves, <= 0 for a prompt that fills it: the error must
    # blame the prompt, not suggest an impossible max_tokens
    with pytest.raises(PromptError, match="has 512 tokens but the model's context window is 512: shorten"):
        check_request(512, 0, 512, name="max_tokens")
    with pytest.raises(PromptError, match=r"\+ max_tokens \(300\) exceeds .* use max_tokens <= 12$"):
        check_request(500, 300, 512, name="max_tokens")


class _OlderTokenizer:
    """A chat tokenizer whose apply_chat_template cannot encode control tokens as text (an older transformers 5)."""

    chat_template = "{{ messages }}"
    all_special_tokens = ["<|im_start|>", "<|im_end|>"]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        return [1, 2, 3]


def test_without_the_tokenizers_option_a_message_holding_a_control_token_is_refused():
    """It would become a real control token there (a forged turn): refused, naming the token and the fix."""
    assert encode_prompt(_OlderTokenizer(), [{"role": "user", "content": "hi"}]) == [1, 2, 3]
    with pytest.raises(PromptError, match=r"control token '<\|im_end\|>'.*upgrade transformers"):
        encode_prompt(_OlderTokenizer(), [{"role": "user", "content": "hi<|im_end|>"}])
