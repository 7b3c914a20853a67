"""Chat prompts for a chat model: one user message each, a question template filled with a topic.

Topics are general subjects and the standard library's modules (coding questions). The split is by topic: a topic
whose SHA-256 falls in the last HELD_OUT_PERCENT is held out, so a draft distilled on the training side
(`smollm2_draft/`) never saw a held-out prompt's subject, only its question shapes. Deterministic for a seed.
"""

from __future__ import annotations

import hashlib
import random
import sys

from load_tests.prompts import Prompt

HELD_OUT_PERCENT = 15

GENERAL_TEMPLATES = (
    "What is {topic}?",
    "Explain {topic} in simple terms.",
    "Give me three interesting facts about {topic}.",
    "Write a short poem about {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "What are the pros and cons of {topic}?",
    "Write a short story that involves {topic}.",
    "Why do people care about {topic}?",
    "Summarize the history of {topic} in a few sentences.",
    "What are common misconceptions about {topic}?",
    "Give me some tips for learning about {topic}.",
    "Write a tweet about {topic}.",
)
CODE_TEMPLATES = (
    "How do I use Python's {topic} module? Show a short example.",
    "What is the Python {topic} module for?",
    "Write a small Python program that uses the {topic} module.",
)
TOPICS = (
    "photosynthesis, black holes, the water cycle, volcanoes, earthquakes, the moon, the solar system, gravity, "
    "electricity, magnetism, rainbows, the human heart, the immune system, vaccines, DNA, evolution, dinosaurs, "
    "climate change, recycling, renewable energy, solar panels, wind turbines, nuclear power, the ocean, coral reefs, "
    "rainforests, deserts, glaciers, bees, ants, whales, dolphins, elephants, cats, dogs, birds migrating, "
    "the Roman Empire, ancient Egypt, the pyramids, the Renaissance, the printing press, the Industrial Revolution, "
    "the internet, smartphones, artificial intelligence, machine learning, robots, electric cars, airplanes, trains, "
    "bicycles, the Olympic Games, football, chess, music, jazz, classical music, painting, photography, poetry, "
    "libraries, museums, coffee, tea, chocolate, bread baking, pizza, cooking pasta, healthy eating, vegetables, "
    "sleep, exercise, meditation, stress, friendship, kindness, time management, saving money, budgeting, inflation, "
    "taxes, democracy, elections, the United Nations, human rights, languages, learning a second language, writing "
    "an essay, public speaking, job interviews, teamwork, leadership, gardening, houseplants, camping, hiking, "
    "mountains, rivers, the Amazon river, the Sahara, Antarctica, Paris, Tokyo, New York, London, volunteering, "
    "online privacy, passwords, computer viruses, databases, cloud computing, video games, movies, theatre, "
    "the stock market, cryptocurrency, banks, the moon landing, Mars, telescopes, microscopes, atoms, chemistry, "
    "mathematics, prime numbers, probability, statistics, geometry, algebra, the number zero, clocks, calendars, "
    "the seasons, weather forecasts, hurricanes, snow, fire safety, first aid, hospitals, doctors, teachers, "
    "schools, homework, reading books, fairy tales, mythology, Greek gods, castles, knights, pirates, the Vikings, "
    "the Silk Road, maps, compasses, lighthouses, bridges, skyscrapers, architecture, cities, farming, cows, "
    "honey, apples, oranges, rice, the potato, salt, water, plastic, glass, paper, cotton, wool, fashion, shoes"
)
GENERAL_TOPICS = tuple(topic.strip() for topic in TOPICS.split(","))
MODULE_TOPICS = tuple(
    sorted(name for name in sys.stdlib_module_names if not name.startswith("_") and name not in ("this", "antigravity"))
)


def is_held_out(topic: str) -> bool:
    """A stable split by topic: held out when the topic's hash falls in the last HELD_OUT_PERCENT."""
    digest = hashlib.sha256(topic.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def all_chat_prompts(held_out: bool) -> list[Prompt]:
    """Every (template, topic) question on one side of the split, in a fixed order."""
    pairs = [(t, topic) for topic in GENERAL_TOPICS for t in GENERAL_TEMPLATES]
    pairs += [(t, topic) for topic in MODULE_TOPICS for t in CODE_TEMPLATES]
    return [
        Prompt("chat", template.format(topic=topic), source=topic)
        for template, topic in pairs
        if is_held_out(topic) == held_out
    ]


def chat_prompts(count: int, seed: int = 0, held_out: bool = True) -> list[Prompt]:
    """`count` chat prompts (user messages) drawn without repeats from one side of the split."""
    pool = all_chat_prompts(held_out)
    if count > len(pool):
        raise ValueError(f"only {len(pool)} chat prompts on this side of the split, asked for {count}")
    return random.Random(seed).sample(pool, count)


def chat_messages(prompt: Prompt) -> list[dict[str, str]]:
    """The prompt as a conversation of one user message (the model's template adds its system prompt)."""
    return [{"role": "user", "content": str(prompt.prompt)}]
