"""A conversation turned into prompt token ids by the target model's own chat template (docs/architecture.md,
"A request's way")."""

from __future__ import annotations

from collections.abc import Sequence

import jinja2
from transformers import PreTrainedTokenizerBase

from specdec.common.errors import InvalidFieldError
from specdec.v1 import coordinator_pb2

MAX_MESSAGES = 256


def chat_prompt_ids(messages: Sequence[coordinator_pb2.ChatMessage], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The template's rendering of the messages followed by the opening of the assistant's reply, as token ids.
    INVALID_ARGUMENT names `messages` when the model has no template or the template refuses the conversation."""
    if tokenizer.chat_template is None:
        raise InvalidFieldError("messages", "the target model has no chat template: send the prompt as text instead")
    if len(messages) > MAX_MESSAGES:
        raise InvalidFieldError("messages", f"at most {MAX_MESSAGES} messages, got {len(messages)}")
    for index, message in enumerate(messages):
        if not message.role:
            raise InvalidFieldError(f"messages[{index}].role", "must not be empty")
    conversation = [{"role": message.role, "content": message.content} for message in messages]
    try:
        encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    except jinja2.TemplateError as error:  # the template's raise_exception, e.g. a role it does not take
        raise InvalidFieldError("messages", f"the model's chat template refuses them: {error}") from None
    ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    if not ids:
        raise InvalidFieldError("messages", "the conversation renders to no tokens")
    return ids
