"""The environment protocol's checks (rollout/environments/base.py) and the calculator's tool
(rollout/environments/calculator.py), in-process; the worker pool is exercised in tests/integration/test_episodes.py."""

from __future__ import annotations

import math

import pytest

from trainingrun.rollout.environments.base import InvalidResult, StepResult, load_class, step_result
from trainingrun.rollout.environments.calculator import CalcError, Calculator, answer_matches, evaluate


@pytest.mark.parametrize("expression, value", [("12 + 7 * 3", 33), ("(1 + 2) ** 3", 27), ("-4 // 3", -2),
                                               ("7 / 2", 3.5), ("-(3 - 10) % 4", 3), (" 5 ", 5)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression, why", [("", "empty"), ("__import__('os')", "not arithmetic"),
                                             ("x + 1", "not arithmetic"), ("2 ** 1000", "exponent"),
                                             ("10 ** 16", "out of range"), ("1 / 0", "division by zero"),
                                             ("(-8) ** 0.5", "out of range"), ("1 +", "cannot parse"),
                                             ("1" * 300, "longer than"), ("True + 1", "not arithmetic")])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expression)


def test_calculator_episode_calls_then_answers():
    env = Calculator(calls=1)
    assert env.reset({"text": "3 + 4 =", "reference": "7"}) == "3 + 4 ="
    first = env.step("<calc> 3 + 4 </calc>")
    assert (first.observation, first.reward, first.done, first.tool_calls, first.tool_errors, first.role) == (
        "7", 0.0, False, 1, 0, "tool")
    over = env.step("<calc> 1 + 1")  # no closing tag: still a call, but none left
    assert over.observation == "error: no calls left" and over.tool_errors == 1 and not over.done
    assert env.step("so it is 7").reward == 1.0
    bad = Calculator().step("<calc> os.system('x') </calc>")
    assert bad.observation.startswith("error:") and bad.tool_errors == 1 and not bad.done
    with pytest.raises(ValueError, match="calls must be"):
        Calculator(calls=-1)


@pytest.mark.parametrize("turn, reference, right", [("7", "7", True), ("it is -37", -37, True), ("7.0", "7", True),
                                                     ("8 then 7", "7", True), ("7 then 8", "7", False),
                                                     ("no number", "7", False), ("7", "seven", False)])
def test_the_final_answer_is_the_turns_last_number(turn, reference, right):
    assert answer_matches(turn, reference) is right


def test_step_results_in_every_accepted_form_and_what_is_refused():
    assert step_result(("obs", 1, False)) == StepResult("obs", 1.0, False)
    assert step_result(("obs", 0.5, False, {"tool_calls": 2, "role": "tool"})) == StepResult(
        "obs", 0.5, False, tool_calls=2, role="tool")
    assert step_result({"observation": 42, "reward": 1.0, "done": True}).observation is None  # not shown when done
    for bad, why in [((42, 0.0, False), "observation must be text"), (("o", math.nan, False), "finite"),
                     (("o", True, False), "finite"), (("o", 0.0, 1), "done must be a bool"),
                     (("o", 0.0, False, {"role": "wizard"}), "role"), (("o", 0.0, False, {"tool_calls": -1}),
                                                                       "non-negative"),
                     (("o", 0.0, False, []), "info must be a dict"), ({"reward": 1.0, "done": True}, "misses"),
                     ("obs", "must return")]:
        with pytest.raises(InvalidResult, match=why):
            step_result(bad)


def test_a_user_class_that_cannot_be_loaded_names_the_field():
    with pytest.raises(ValueError, match=r"environment\.className: cannot load 'tests\.envs_fixture:Nope'"):
        load_class("tests.envs_fixture:Nope")
    with pytest.raises(ValueError, match=r"environment\.className: cannot load 'no_such_module_x:Env'"):
        load_class("no_such_module_x:Env")
    assert load_class("tests.envs_fixture:Echo").__name__ == "Echo"


def test_reasoning_gym_environment_gives_feedback_until_right_or_out_of_attempts():
    pytest.importorskip("reasoning_gym")
    from trainingrun.rollout.environments.reasoning import ReasoningGymRetry, dataset

    params = {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2}, "seed": 3, "size": 10}
    entry = dataset(params)[4]
    prompt = {"text": None, "index": 4, "dataset": params}
    env = ReasoningGymRetry(attempts=3, feedback="no.", decay=0.5)
    assert env.reset(prompt) == entry["question"]
    wrong = env.step("-123456")
    assert (wrong.observation, wrong.reward, wrong.done, wrong.role) == ("no.", 0.0, False, "user")
    right = env.step(f" {entry['answer']} ")
    assert right.done and right.reward == 0.5  # right at the second attempt: decay¹
    out = ReasoningGymRetry(attempts=2)
    out.reset(prompt)
    out.step("x")
    last = out.step("y")
    assert last.done and last.reward == 0.0  # out of attempts: its score ends the episode
    with pytest.raises(ValueError, match="needs reasoningGym prompts"):
        ReasoningGymRetry().reset({"text": "q", "index": 0})
    with pytest.raises(ValueError, match="attempts must be"):
        ReasoningGymRetry(attempts=0)
