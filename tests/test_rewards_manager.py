"""RewardManager: weights, None handling, and failure containment (timeouts, exceptions,
NaN, wrong lengths, dead workers) in process, thread and inline modes.

The reward functions below are module-level so worker processes can import them.
"""

import functools
import math
import os
import time

import numpy as np
import pytest

from grpojax.rewards import RewardManager, RewardSpec, check_picklable
from grpojax.rewards import manager as manager_module


def length_reward(prompts, completions):
    return [float(len(c)) for c in completions]


def prompt_len_reward(prompts, completions):
    return [float(len(p)) for p in prompts]


def answer_match(prompts, completions, *, answer):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def sleep_on(prompts, completions, *, marker="HANG", sleep_s=60.0):
    if any(marker in c for c in completions):
        time.sleep(sleep_s)
    return [1.0] * len(completions)


def _slow_to_load(delay_s):
    time.sleep(delay_s)
    return length_reward


class SlowToUnpickle:
    """length_reward, but unpickling it in a worker takes `delay_s` (as a slow import or a
    worker that is not scheduled would)."""

    def __init__(self, delay_s):
        self.delay_s = delay_s

    def __call__(self, prompts, completions):
        return length_reward(prompts, completions)

    def __reduce__(self):
        return _slow_to_load, (self.delay_s,)


def raise_on(prompts, completions, *, marker="BOOM"):
    if any(marker in c for c in completions):
        raise RuntimeError("reward exploded")
    return [1.0] * len(completions)


def nonfinite_on(prompts, completions):
    table = {"NAN": float("nan"), "INF": float("inf")}
    return [table.get(c, 2.0) for c in completions]


def wrong_length(prompts, completions):
    return [1.0] * (len(completions) + 1)


def none_on(prompts, completions, *, marker="NONE", value=1.0):
    return [None if marker in c else value for c in completions]


def die_on(prompts, completions, *, marker="DIE"):
    if any(marker in c for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def column_count(prompts, completions, **columns):
    return [float(len(columns))] * len(completions)


def reference_total(values_fn, weights):
    """NumPy reference: sum of weight * value over functions with a value (None skipped)."""
    n = len(values_fn[0])
    total = np.zeros(n)
    scored = np.zeros(n, bool)
    for vals, w in zip(values_fn, weights):
        for i, v in enumerate(vals):
            if v is not None:
                total[i] += w * v
                scored[i] = True
    return np.where(scored, total, 0.0), scored


def test_weights_per_function_and_stats():
    prompts = ["ab", "c", "def", "", "gh"]
    completions = ["x", "yy", "12", "zzzz", "3"]
    answer = ["x", "y", "12", "q", "3"]
    fns = [length_reward, answer_match, prompt_len_reward]
    weights = [0.5, 2.0, -1.0]
    with RewardManager(fns, weights=weights, num_workers=2, timeout_s=20.0) as mgr:
        res = mgr.compute(prompts, completions, answer=answer, unused=[0] * 5)
    ref_vals = [
        [len(c) for c in completions],
        [float(c == a) for c, a in zip(completions, answer)],
        [len(p) for p in prompts],
    ]
    ref_total, _ = reference_total(ref_vals, weights)
    assert res.total_n.dtype == np.float32 and res.total_n.shape == (5,)
    np.testing.assert_allclose(res.total_n, ref_total, rtol=0, atol=1e-6)
    assert res.valid_n.all()
    for name, vals in zip(["length_reward", "answer_match", "prompt_len_reward"], ref_vals):
        np.testing.assert_array_equal(res.per_fn[name], np.array(vals, np.float32))
        assert res.stats[f"rewards/{name}/mean"] == pytest.approx(np.mean(vals), abs=1e-12)
        assert res.stats[f"rewards/{name}/std"] == pytest.approx(np.std(vals), abs=1e-12)
        assert res.stats[f"rewards/{name}/timeouts"] == 0.0
    assert res.stats["rewards/total/mean"] == pytest.approx(ref_total.mean(), abs=1e-5)
    assert res.stats["rewards/valid_frac"] == 1.0


def test_hanging_function_times_out_and_masks_only_its_samples():
    completions = ["a", "HANG", "b", "c"]
    timeout = 1.5
    with RewardManager(
        [sleep_on, length_reward], num_workers=2, timeout_s=timeout, chunk_size=1
    ) as mgr:
        t0 = time.monotonic()
        res = mgr.compute([""] * 4, completions)
        elapsed = time.monotonic() - t0
        # one timeout window plus scheduling slack; the function itself sleeps 60 s
        assert elapsed < timeout + 3.0, elapsed
        np.testing.assert_array_equal(res.valid_n, [True, False, True, True])
        np.testing.assert_array_equal(res.failed_fn["sleep_on"], [False, True, False, False])
        assert not res.failed_fn["length_reward"].any()
        assert res.stats["rewards/sleep_on/timeouts"] == 1.0
        assert res.stats["rewards/worker_restarts"] >= 1.0
        np.testing.assert_allclose(res.total_n, [2.0, 0.0, 2.0, 2.0], atol=0)
        assert np.isfinite(res.total_n).all()
        assert np.isnan(res.per_fn["sleep_on"][1])
        # the replaced worker serves the next call
        res2 = mgr.compute([""] * 2, ["a", "b"])
        np.testing.assert_allclose(res2.total_n, [2.0, 2.0], atol=0)
        assert mgr.totals[("sleep_on", "timeouts")] == 1


def test_timeout_charges_the_call_not_its_hand_over(monkeypatch):
    # The function takes 2 s to unpickle in its worker, longer than timeout_s, and then
    # runs at once: nothing times out, and the wait is reported as the hand-over.
    slow = RewardSpec(SlowToUnpickle(2.0), name="slow_load")
    with RewardManager([slow], num_workers=1, timeout_s=1.0) as mgr:
        res = mgr.compute([""] * 2, ["a", "bb"])
    np.testing.assert_array_equal(res.valid_n, [True, True])
    np.testing.assert_allclose(res.total_n, [1.0, 2.0], atol=0)
    assert res.stats["rewards/slow_load/timeouts"] == 0.0
    assert 2.0 <= res.stats["rewards/handover_s"] < 30.0
    # A hand-over that hangs is bounded by its own limit (shortened here) and is a timeout.
    monkeypatch.setattr(manager_module, "_HANDOVER_TIMEOUT_S", 1.0)
    hung = RewardSpec(SlowToUnpickle(60.0), name="hung_load")
    with RewardManager([hung], num_workers=1, timeout_s=30.0) as mgr:
        t0 = time.monotonic()
        res = mgr.compute([""], ["a"])
        elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 3.0, elapsed
    assert not res.valid_n.any() and res.stats["rewards/hung_load/timeouts"] == 1.0
    assert "did not start within 1 s of being handed to its worker" in res.errors[0]


def test_raise_and_nonfinite_are_masked_and_counted():
    completions = ["ok", "BOOM", "NAN", "fine", "INF", "x"]
    with RewardManager([raise_on, nonfinite_on], num_workers=2, chunk_size=2) as mgr:
        res = mgr.compute([""] * 6, completions)
    # raise_on fails its whole chunk [0:2]; nonfinite_on fails exactly samples 2 and 4
    np.testing.assert_array_equal(res.failed_fn["raise_on"], [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(res.failed_fn["nonfinite_on"], [0, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(res.valid_n, [0, 0, 0, 1, 0, 1])
    np.testing.assert_allclose(res.total_n, [0, 0, 0, 3.0, 0, 3.0], atol=0)
    assert res.stats["rewards/raise_on/exceptions"] == 1.0
    assert res.stats["rewards/nonfinite_on/nonfinite"] == 2.0
    assert res.stats["rewards/nonfinite_on/mean"] == 2.0  # over finite values only
    assert any("reward exploded" in e for e in res.errors)


def test_wrong_length_counted():
    with RewardManager([wrong_length, length_reward], num_workers=1) as mgr:
        res = mgr.compute(["", ""], ["a", "bb"])
    assert res.stats["rewards/wrong_length/wrong_length"] == 1.0
    assert not res.valid_n.any()
    np.testing.assert_array_equal(res.total_n, [0.0, 0.0])
    np.testing.assert_array_equal(res.per_fn["length_reward"], [1.0, 2.0])


def test_none_is_no_opinion():
    # f1 abstains on "NONE..."; f2 abstains on anything containing "NO".
    f1 = RewardSpec(none_on, weight=1.0, name="f1")
    f2 = RewardSpec(functools.partial(none_on, marker="NO", value=3.0), weight=2.0, name="f2")
    completions = ["yes", "NO", "NONE"]
    with RewardManager([f1, f2], num_workers=2) as mgr:
        res = mgr.compute([""] * 3, completions)
    ref_total, scored = reference_total([[1.0, 1.0, None], [3.0, None, None]], [1.0, 2.0])
    np.testing.assert_allclose(res.total_n, ref_total, atol=0)  # [7, 1, 0]
    np.testing.assert_array_equal(res.valid_n, scored)  # nobody scored "NONE": masked
    assert res.stats["rewards/f1/none"] == 1.0 and res.stats["rewards/f2/none"] == 2.0
    assert res.stats["rewards/f2/mean"] == 3.0 and res.stats["rewards/f2/failed"] == 0.0


def test_dead_worker_is_replaced():
    with RewardManager([die_on], num_workers=1, chunk_size=1) as mgr:
        res = mgr.compute(["", ""], ["DIE", "ok"])
        np.testing.assert_array_equal(res.valid_n, [False, True])
        assert res.stats["rewards/die_on/worker_deaths"] == 1.0
        assert mgr.compute([""], ["ok"]).valid_n.all()


def test_columns_routed_by_signature():
    with RewardManager([column_count, answer_match], mode="thread") as mgr:
        res = mgr.compute(["p"], ["a"], answer=["a"], other=[1], third=["z"])
        assert res.per_fn["column_count"][0] == 3.0  # **columns gets them all
        assert res.per_fn["answer_match"][0] == 1.0  # only `answer` is passed
        with pytest.raises(ValueError, match=r"needs column.*'answer'"):
            mgr.compute(["p"], ["a"], other=[1])
        with pytest.raises(ValueError, match="column 'answer' has 2 values for 1"):
            mgr.compute(["p"], ["a"], answer=["a", "b"])


def test_unpicklable_function_is_refused_with_its_name():
    def local_reward(prompts, completions):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=r"'local_reward'.*cannot be pickled.*mode='thread'"):
        RewardManager([local_reward])
    with pytest.raises(ValueError, match=r"'mine'.*cannot be pickled"):
        RewardManager([RewardSpec(lambda p, c: [0.0] * len(c), name="mine")])
    assert check_picklable(functools.partial(sleep_on, sleep_s=1.0))


def test_thread_mode_runs_unpicklable_and_abandons_hung_threads():
    scale = 3.0
    closure = lambda p, c: [scale * len(x) for x in c]
    hang = functools.partial(sleep_on, sleep_s=8.0)
    with RewardManager(
        [RewardSpec(closure, name="closure"), RewardSpec(hang, name="hang")],
        mode="thread",
        num_workers=2,
        timeout_s=1.0,
        chunk_size=1,
    ) as mgr:
        t0 = time.monotonic()
        res = mgr.compute(["", ""], ["ab", "HANG"])
        assert time.monotonic() - t0 < 4.0
    np.testing.assert_array_equal(res.valid_n, [True, False])
    np.testing.assert_allclose(res.total_n, [7.0, 0.0], atol=0)
    assert res.stats["rewards/hang/timeouts"] == 1.0


def test_inline_and_process_modes_together():
    inline = RewardSpec(raise_on, name="inline_raise", mode="inline", weight=10.0)
    with RewardManager([inline, length_reward], num_workers=1, chunk_size=1) as mgr:
        res = mgr.compute(["", ""], ["BOOM", "abc"], answer=["", ""])
    np.testing.assert_array_equal(res.valid_n, [False, True])
    np.testing.assert_allclose(res.total_n, [0.0, 13.0], atol=0)
    assert res.stats["rewards/inline_raise/exceptions"] == 1.0


def test_close_stops_workers():
    mgr = RewardManager([length_reward], num_workers=2).start()
    procs = [w.proc for w in mgr._backends["process"].workers]
    assert all(p.is_alive() for p in procs)
    mgr.close()
    assert not any(p.is_alive() for p in procs)
    mgr.close()  # idempotent


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mode="subprocess"), "mode must be one of"),
        (dict(start_method="fork"), "never 'fork'"),
        (dict(num_workers=0), r"^num_workers must be an int >= 1, got 0$"),
        (dict(timeout_s=0), r"^timeout_s must be a finite number > 0, got 0$"),
        (dict(chunk_size=0), r"^chunk_size must be None or an int >= 1, got 0$"),
        (dict(weights=[1.0, 2.0]), "weights has 2 entries for 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardManager([length_reward], **kwargs)


def test_bad_specs():
    with pytest.raises(ValueError, match="unique"):
        RewardManager([length_reward, length_reward])
    with pytest.raises(ValueError, match=r"^weight must be a finite number, got nan$"):
        RewardSpec(length_reward, weight=math.nan)
    with pytest.raises(ValueError, match=r"^mode must be one of \('process', 'thread', 'inline'\)"):
        RewardSpec(length_reward, mode="gpu")


def test_a_worker_dying_at_start_names_a_script_without_a_main_guard(tmp_path, monkeypatch):
    """Reward workers import the script that started the run again (forkserver and spawn):
    one that trains at its top level starts a run in each worker, which dies. The start-up
    error then names the script and the main guard; with a guard (or no script) it adds
    nothing."""
    import sys
    import types

    from grpojax.rewards import manager

    script = tmp_path / "my_run.py"
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    monkeypatch.setitem(sys.modules, "__main__", main)
    script.write_text("from grpojax.driver import train\ntrain(cfg)\n")
    hint = manager._script_hint()
    assert "my_run.py again" in hint and 'if __name__ == "__main__":' in hint
    script.write_text('if __name__ == "__main__":\n    train(cfg)\n')
    assert manager._script_hint() == ""
    del main.__file__  # an interactive session
    assert manager._script_hint() == ""
