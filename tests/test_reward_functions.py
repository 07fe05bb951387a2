"""User reward functions named in the config (`rewards.functions=["pkg.module:fn"]`): the
import and signature checks, the weights convention, and a driver run that scores with one
in the process pool."""

from __future__ import annotations

import json
import os
import textwrap
import uuid

import pytest

from grpojax.config import ConfigError, load_config
from grpojax.driver.setup import build_reward_manager, check_reward_columns

_SOURCE = """
import os

PARENT_PID = {pid}
NOT_CALLABLE = 3


def in_worker(prompts, completions, **columns):
    # 1.0 only when called in another process than the test's (the manager's worker).
    return [1.0 if os.getpid() != PARENT_PID else 0.0 for _ in completions]


def matches_answer(prompts, completions, *, answer):
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]


def needs_column(prompts, completions, *, no_such_column):
    return [0.0 for _ in completions]


def one_argument(completions):
    return [0.0 for _ in completions]


def keyword_only(*, prompts, completions):
    return [0.0 for _ in completions]


class Holder:
    @staticmethod
    def nested(prompts, completions, **_):
        return [0.5 for _ in completions]
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """A module of reward functions written to tmp_path and put on sys.path (a fresh name,
    so no other test's module of the same name is cached)."""
    name = f"user_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_SOURCE.format(pid=os.getpid())))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_functions_resolve_and_weights_follow_names_then_functions(reward_module):
    m = reward_module
    cfg = load_config(
        None,
        [
            f"rewards.functions=[{m}:matches_answer,{m}:Holder.nested]",
            "rewards.weights=[0.5,2.0,3.0]",
            "rewards.mode=thread",
        ],
    )
    assert cfg.rewards.log_names == ("numeric_answer", "matches_answer", "nested")
    with build_reward_manager(cfg) as manager:
        assert manager.names == ["numeric_answer", "matches_answer", "nested"]
        assert manager.weights == [0.5, 2.0, 3.0]
        res = manager.compute(["1+1="], ["2"], answer=["2"])
    assert res.per_fn["matches_answer"].tolist() == [1.0]
    assert res.per_fn["nested"].tolist() == [0.5]
    assert res.total_n.tolist() == [0.5 * 1.0 + 2.0 * 1.0 + 3.0 * 0.5]


def test_names_may_be_empty_when_functions_are_given(reward_module):
    cfg = load_config(
        None, ["rewards.names=[]", f"rewards.functions=[{reward_module}:matches_answer]"]
    )
    assert cfg.rewards.log_names == ("matches_answer",)
    assert cfg.rewards.resolved_weights == (1.0,)
    with pytest.raises(ConfigError, match=r"^rewards\.names must list at least one reward"):
        load_config(None, ["rewards.names=[]"])


@pytest.mark.parametrize(
    ("path", "pattern"),
    [
        (
            "no_colon_here",
            r"^rewards\.functions: 'no_colon_here' must look like 'package\.module:function'$",
        ),
        ("a:b:c", r"^rewards\.functions: 'a:b:c' must look like"),
        (
            "no_such_module_qq:fn",
            r"^rewards\.functions: cannot import module 'no_such_module_qq' "
            r".*ModuleNotFoundError",
        ),
        ("{m}:missing", r"^rewards\.functions: module '{m}' has no attribute 'missing'$"),
        (
            "{m}:NOT_CALLABLE",
            r"^rewards\.functions: '{m}:NOT_CALLABLE' is a int, not a callable "
            r"fn\(prompts, completions, \*\*columns\)",
        ),
        (
            "{m}:one_argument",
            r"^rewards\.functions: '{m}:one_argument' must be a function "
            r"fn\(prompts, completions, \*\*columns\).*its signature \(completions\)",
        ),
        ("{m}:keyword_only", r"^rewards\.functions: '{m}:keyword_only' must be a function"),
    ],
)
def test_bad_function_paths_are_one_error_naming_the_field(reward_module, path, pattern):
    path, pattern = path.replace("{m}", reward_module), pattern.replace("{m}", reward_module)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(None, [f"rewards.functions=[{path}]"])
    assert "\n" not in str(info.value) and info.value.__cause__ is None


def test_weights_count_and_repeated_log_names(reward_module):
    m = reward_module
    with pytest.raises(
        ConfigError,
        match=r"^rewards\.weights must have one entry per reward: 1 for names then 1 for "
        r"functions \(2\), got 1$",
    ):
        load_config(None, [f"rewards.functions=[{m}:in_worker]", "rewards.weights=[1.0]"])
    with pytest.raises(
        ConfigError,
        match=r"^rewards\.functions: rewards are logged by name and \['in_worker'\] would repeat",
    ):
        load_config(None, [f"rewards.functions=[{m}:in_worker,{m}:in_worker]"])


def test_missing_column_of_a_user_function_names_the_field(reward_module):
    cfg = load_config(None, [f"rewards.functions=[{reward_module}:needs_column]"])
    from grpojax.errors import UserError

    with pytest.raises(
        UserError,
        match=r"^rewards\.functions: the '.*:needs_column' reward reads the column\(s\) "
        r"\['no_such_column'\]",
    ):
        check_reward_columns(cfg, [{"prompt": "1+1=", "answer": "2"}])
    check_reward_columns(
        load_config(None, [f"rewards.functions=[{reward_module}:matches_answer]"]),
        [{"prompt": "1+1=", "answer": "2"}],
    )


def test_process_workers_import_a_module_put_on_sys_path_after_the_fork_server_started(
    tmp_path, monkeypatch
):
    """The fork server keeps the sys.path it started with; a worker started later still
    imports a reward module from a directory added to sys.path since."""
    from grpojax.rewards import RewardManager, format_reward

    with RewardManager([format_reward], mode="process", num_workers=1) as early:
        assert early.compute(["p"], ["c"]).valid_n.all()  # the fork server is running now
    name = f"late_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import os\n\ndef pid(prompts, completions, **_):\n"
        "    return [float(os.getpid()) for _ in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["rewards.names=[]", f"rewards.functions=[{name}:pid]"])
    with build_reward_manager(cfg) as manager:
        res = manager.compute(["p", "q"], ["a", "b"])
    assert res.valid_n.all(), res.errors
    assert (res.per_fn["pid"] != os.getpid()).all()


def test_driver_scores_with_a_user_function_in_worker_processes(
    reward_module, small_model_dir, tmp_path
):
    """`grpojax train`'s loop with a user function run in the process pool (imported there by
    name): it is logged on its own and enters the total with its weight."""
    from grpojax.driver.loop import train

    run_dir = tmp_path / "run"
    overrides = {
        "model.source": str(small_model_dir),
        "log.run_dir": str(run_dir),
        "log.progress": "false",
        "log.tensorboard": "false",
        "log.plot": "false",
        "data.name": "chain3",
        "data.size": "50",
        "rollout.prompts_per_step": "2",
        "rollout.max_new_tokens": "3",
        "grpo.group_size": "2",
        "eval.heldout_size": "2",
        "eval.batch_size": "2",
        "eval.k": "1",
        "checkpoint.every": "10",
        "checkpoint.async_save": "false",
        "sft.steps": "0",
        "total_steps": "2",
        "rewards.mode": "process",
        "rewards.num_workers": "1",
        "rewards.functions": f"[{reward_module}:in_worker]",
        "rewards.weights": "[0.0,2.0]",
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    result = train(cfg, show_progress=False, print_fn=lambda s: None)
    assert result.steps == 2
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rl = [r for r in map(json.loads, lines) if "reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert r["reward/in_worker"] == 1.0  # ran, in a worker process
        assert "reward/numeric_answer" in r
        assert r["reward_mean"] == pytest.approx(2.0)  # 0 x numeric_answer + 2 x in_worker
