"""The SmolLM2 draft's card: every training run of the chain, its answer sets, and the commands that redo them."""

from __future__ import annotations

import argparse

import pytest

from smollm2_draft.model_card import answer_counts, reproduce_lines, run_chain, training_lines
from smollm2_draft.train import answer_sets


def run(steps: int, answers: int, before: dict | None = None, layers: int = 2, **sets: int) -> dict:
    return {
        "steps": steps,
        "train_seconds": 60.0 * steps / 100,
        "final_train_loss": 3.5,
        "settings": {"learning_rate": 0.001},
        "shape": {"layers": layers, "of_target_layers": 30},
        "training_data": {"answers": answers, "answer_tokens": answers * 100, **sets},
        "deepened_from": before,
    }


def chain() -> dict:
    first = run(800, 2358)
    second = run(700, 5558, first, answers_to_self_written_prompts=3200)
    return run(400, 3894, second, answers_to_self_written_prompts=0, answers_to_requests_for_json=1536)


def test_the_chain_runs_first_to_last_with_each_runs_answer_sets():
    runs = run_chain(chain())
    assert [r["steps"] for r in runs] == [800, 700, 400]
    assert [answer_counts(r) for r in runs] == [
        {"template": 2358},
        {"template": 2358, "self": 3200},
        {"template": 2358, "json": 1536},
    ]


def test_the_commands_make_each_answer_set_before_the_first_run_that_uses_it():
    assert reproduce_lines(chain()) == [
        "python -m smollm2_draft.train draft --layers 2 --steps 800 --learning-rate 0.001 --answer-sets template",
        "python -m smollm2_draft.train self-answers --self-prompts 3200",
        "python -m smollm2_draft.train draft --layers 2 --steps 700 --learning-rate 0.001 --answer-sets "
        "template,self --deepen models/smollm2-draft",
        "python -m smollm2_draft.train json-answers --json-answers 1536",
        "python -m smollm2_draft.train draft --layers 2 --steps 400 --learning-rate 0.001 --answer-sets "
        "template,json --deepen models/smollm2-draft",
    ]


def test_the_training_table_has_a_row_a_run_and_a_deepened_run_says_so():
    deeper = run(300, 2358, run(800, 2358), layers=4)
    rows = [line for line in training_lines(deeper) if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 2
    assert "run 1, deepened by the target's next 2" in rows[1]
    assert "2,358 template (235,800)" in rows[0]
    assert len([line for line in training_lines(chain()) if line.startswith("| ") and line[2].isdigit()]) == 3


def test_the_trainer_takes_the_cards_answer_set_names_and_refuses_others():
    assert answer_sets("template,json") == {"template", "json"}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown answer sets \\['jsn'\\]"):
        answer_sets("template,jsn")
