"""Self-written chat prompts keep the topic split: a message naming a held-out topic (any form of its last word) is
dropped, one on a training-side topic is kept."""

from __future__ import annotations

import pytest

from load_tests.chat_prompts import GENERAL_TOPICS, MODULE_TOPICS, all_chat_prompts, is_held_out
from smollm2_draft.self_prompts import held_out_pattern


@pytest.mark.parametrize("topic", [t for t in (*GENERAL_TOPICS, *MODULE_TOPICS) if is_held_out(t)])
def test_every_held_out_topic_is_caught_in_a_message(topic):
    assert held_out_pattern().search(f"Could you tell me more about {topic.upper()} today?")


def test_other_forms_of_a_held_out_topic_are_caught():
    pattern = held_out_pattern()
    held_out = [t for t in GENERAL_TOPICS if is_held_out(t)]
    assert "gardening" in held_out and "dogs" in held_out and "teachers" in held_out
    for message in ("We planted a community garden.", "My dog barks.", "A teacher asked me."):
        assert pattern.search(message), message


def test_every_held_out_chat_prompt_is_caught_and_most_training_prompts_are_kept():
    pattern = held_out_pattern()
    assert all(pattern.search(prompt.prompt) for prompt in all_chat_prompts(held_out=True))
    training = all_chat_prompts(held_out=False)
    kept = [prompt for prompt in training if not pattern.search(prompt.prompt)]
    assert len(kept) >= 0.9 * len(training)
