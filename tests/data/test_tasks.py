from __future__ import annotations

import itertools
import random

import pytest

import rlnb
from rlnb.data import Task, addition, get_task, register_task, reverse, sort, task_names

CORRECT = {
    "addition": lambda prompt: str(sum(map(int, prompt.rstrip("=").split("+")))),
    "reverse": lambda prompt: prompt.rstrip("=")[::-1],
    "sort": lambda prompt: "".join(sorted(prompt.rstrip("="))),
}


@pytest.mark.parametrize("task", [addition, reverse, sort], ids=lambda t: t.name)
def test_builtin_tasks_are_reproducible_verifiable_and_fit_their_alphabet(task: Task) -> None:
    first = list(itertools.islice(task.prompts(seed=3), 20))
    assert first == list(itertools.islice(task.prompts(seed=3), 20))
    assert first != list(itertools.islice(task.prompts(seed=4), 20))
    for item in first:
        assert item.answer == CORRECT[task.name](item.prompt)
        assert set(item.prompt) | set(item.answer) <= set(task.alphabet)
        assert len(item.answer) + 1 <= task.max_new_tokens  # room for end-of-sequence
        assert task.reward(item.answer, item.answer) == 1.0
        wrong = item.answer[:-1] + ("0" if item.answer[-1] != "0" else "1")
        assert 0.0 <= task.reward(wrong, item.answer) < 0.5  # partial credit stays below 0.5
        assert task.reward("", item.answer) == 0.0
    held_out = task.eval_set(50)
    assert held_out == task.eval_set(50)
    assert {i.prompt_id for i in held_out}.isdisjoint({i.prompt_id for i in first})


def test_task_names_and_unknown_task_error() -> None:
    assert {"addition", "reverse", "sort"} <= set(task_names())
    with pytest.raises(rlnb.ConfigError, match="use one of"):
        get_task("nope")
    with pytest.raises(rlnb.ConfigError, match=r"Config\.task='nope'"):
        rlnb.Config(task="nope")


def test_a_task_made_from_notebook_callables_drives_a_session() -> None:
    def make_prompt(rng: random.Random) -> tuple[str, str]:
        n = rng.randint(1, 9)
        return f"{n}*2=", str(2 * n)

    task = register_task(
        Task(
            name="double",
            alphabet="0123456789*=",
            make_prompt=make_prompt,
            reward=lambda completion, answer: float(completion == answer),
            max_new_tokens=3,
        ),
        replace=True,
    )
    with pytest.raises(rlnb.ConfigError, match="exists already"):
        register_task(Task("double", "0", make_prompt, lambda c, a: 0.0, 1))
    config = rlnb.Config(task="double", model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(rlnb.ConfigError, match="num_workers=0"):  # workers cannot import a cell's functions
        rlnb.Session(config, name="user-task")
    config = config.replace(data=rlnb.DataConfig(num_workers=0))  # so the kernel makes the prompts
    with rlnb.Session(config, name="user-task") as sess:
        assert sess.task is task
        batch = sess.rollout(2)
        assert all(g.prompt.endswith("*2=") for g in batch)


def test_swapping_the_reward_takes_effect_at_the_next_rollout() -> None:
    config = rlnb.Config(
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2), rollout=rlnb.RolloutConfig(group_size=4)
    )
    with rlnb.Session(config, name="reward-swap") as sess:
        before = sess.rollout(1)
        sess.rollouts.set_reward(lambda completion, answer: 0.25)
        after = sess.rollout(2)
        assert {s.reward for g in after for s in g.samples} == {0.25}
        for group in before:  # scored before the swap: the task's own reward, unchanged
            answer = CORRECT["addition"](group.prompt)
            assert [s.reward for s in group.samples] == [addition.reward(s.completion, answer) for s in group.samples]
        with pytest.raises(TypeError, match="callable"):
            sess.rollouts.set_reward("not a function")  # type: ignore[arg-type]


def test_the_sloppy_teacher_reverses_the_same_words_and_drops_the_last_letter_of_long_ones() -> None:
    sloppy = get_task("sloppy_reverse")
    made = [sloppy.make_prompt(random.Random(i)) for i in range(2000)]
    assert [p for p, _ in made] == [reverse.make_prompt(random.Random(i))[0] for i in range(2000)]  # same words
    slips = 0
    for prompt, answer in made:
        word = prompt.rstrip("=")
        if len(word) < 4:
            assert answer == word[::-1]  # short words: always right
        else:
            assert answer in (word[::-1], word[::-1][:-1])
            slips += answer != word[::-1]
    long_words = sum(len(p) > 4 for p, _ in made)
    assert 0.55 < slips / long_words < 0.65  # SLOPPY_SLIP_RATE, 0.6
    assert "sloppy teacher" in sloppy.about


def test_a_warm_up_imitates_the_teacher_task_it_is_given() -> None:
    """WarmupConfig(task=...): the demonstrations are that task's answers, and the
    policy learns to write them (here a teacher that answers "ab" to everything)."""
    register_task(
        Task("says_ab", reverse.alphabet, lambda rng: (reverse.make_prompt(rng)[0], "ab"), reverse.reward, 7),
        replace=True,
    )
    config = rlnb.Config(
        task="reverse",
        data=rlnb.DataConfig(num_workers=0),
        model=rlnb.ModelConfig(d_model=32, n_layers=1, n_heads=2),
        warmup=rlnb.WarmupConfig(steps=40, batch_size=32, lr=3e-3, task="says_ab"),
    )
    with rlnb.Session(config, name="teacher") as sess:
        sess.warmup(progress=False)
        written = sess.complete([i.prompt for i in reverse.eval_set(20)], max_new_tokens=7)
    assert written == ["ab"] * 20, written


def test_a_task_shows_in_one_short_line_where_a_cell_echoes_it() -> None:
    # A notebook cell that ends in register_task(task) echoes the task it returns.
    def times7(rng: random.Random) -> tuple[str, str]:
        n = rng.randint(0, 99)
        return f"{n}*7=", str(7 * n)

    task = Task("times7", "0123456789*=", times7, addition.reward, 4, about="x*7 of two digits")
    shown = repr(register_task(task, replace=True))
    assert shown == "Task('times7', alphabet='0123456789*=', max_new_tokens=4)"
    assert repr(reverse) == "Task('reverse', alphabet='abcdefgh=', max_new_tokens=7)"
    wide = Task("wide", "".join(map(chr, range(33, 127))), times7, addition.reward, 4)
    assert len(repr(wide)) < 100 and repr(wide).endswith("...', max_new_tokens=4)")
