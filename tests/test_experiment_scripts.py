"""The Qwen-scale experiment scripts: their architecture tables and that the rehearsal starts
(the real runs take minutes to hours and are not part of the suite)."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def _script(name: str) -> pathlib.Path:
    """The experiment script NAME.py, in whichever folder of `experiments/` holds it (bench,
    studies, tools)."""
    (path,) = EXPERIMENTS.glob(f"*/{name}.py")
    return path


def _load(name):
    spec = importlib.util.spec_from_file_location(name, _script(name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "size, params",
    # The published models' parameter counts (safetensors totals, tied embedding once).
    [
        ("0.5b", 494_032_768),
        ("1.5b", 1_543_714_304),
        ("7b", 7_615_616_512),
        ("8b", 8_190_735_360),
        ("30b-a3b", 30_532_122_624),  # Qwen3-30B-A3B: 128 experts of 768, top 8
        ("gemma3-1b", 999_885_952),  # Gemma-3-1B (text only)
        # Gemma-3-4B / 12B: the language model's tensors (their checkpoints add a vision tower)
        ("gemma3-4b", 3_880_263_168),
        ("gemma3-12b", 11_766_034_176),
    ],
)
def test_plan_memory_architectures_have_the_published_parameter_counts(size, params):
    plan = _load("plan_memory")
    cfg = plan.model_config(plan.ARCHS[size])
    assert cfg.num_params() == params
    assert (cfg.dtype, cfg.param_dtype, cfg.remat) == ("bfloat16", "float32", "full")


def test_rehearsal_dry_run_builds_tokenizer_checkpoint_and_run_config(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(_script("rehearse_qwen2_5_0_5b")),
            "--tiny",
            "--dry-run",
            "--keep",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"rehearsal: params=\d+ peak_rss_mb=\d+ step_s=nan export_max_abs_logit_diff=nan", last
    )
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    assert (tmp_path / "train.jsonl").is_file()


def _fake_run(pass1_final, xla_peak_mb, step_time_s, steps=4, compile_steps=(1,)):
    """A worker result as `ppo_vs_grpo.rl_worker` returns it (hand-made numbers). A step
    that compiled takes 10 s: the medians must leave it out."""
    rows = [
        dict(
            step=i + 1,
            wall_s=step_time_s * (i + 1),
            reward_mean=0.1 * i,
            step_time_s=10.0 if i + 1 in compile_steps else step_time_s,
            generate_s=0.25 * step_time_s,
            reward_s=0.0,
            logprobs_s=0.0,
            update_s=0.75 * step_time_s,
        )
        for i in range(steps)
    ]
    evals = [
        dict(step=0, pass1=0.25, mean_k=0.2, wall_s=0.0),
        dict(step=steps, pass1=pass1_final, mean_k=0.5, wall_s=step_time_s * steps),
    ]
    memory = dict(xla_peak_mb=xla_peak_mb, xla_argument_mb=1.0, xla_output_mb=1.0, xla_temp_mb=2.0)
    return dict(
        steps=rows,
        evals=evals,
        memory=memory,
        rss_peak_mb=900.0,
        wall_s=10.0,
        samples_total=64,
        completions_per_step=16,
        compiled_steps=len(compile_steps),
        compile_steps=list(compile_steps),
    )


def test_ppo_vs_grpo_outputs_are_aggregated_by_hand_and_checked(tmp_path):
    """The tables, figures and last line from hand-made worker results: the summary's mean
    and sample std over seeds, the memory ratio, and `check_outputs` (which the notebook
    `02_ppo_vs_grpo` runs on a real `--quick` run) refusing a NaN, a missing figure and a
    missing table row. The real `--quick` run itself is executed once, by that notebook in
    tests/test_notebooks.py, so the suite pays for it once."""
    pvg = _load("ppo_vs_grpo")
    results = {
        ("arithmetic", "grpo", 0): _fake_run(0.5, 100.0, 0.2),
        ("arithmetic", "grpo", 1): _fake_run(0.7, 100.0, 0.2),
        ("arithmetic", "ppo_separate", 0): _fake_run(0.4, 250.0, 0.5),
        # Two more prompt buckets compiled the step again at steps 2 and 3.
        ("arithmetic", "ppo_separate", 1): _fake_run(0.6, 250.0, 0.5, compile_steps=(1, 2, 3)),
    }
    mode = pvg.build_mode(
        pvg.parse_args(["--quick", "--algos", "grpo", "ppo_separate", "--seeds", "2"])
    )
    line = pvg.write_outputs(tmp_path, results, mode, wall=12.5, failed=0)
    assert line == (
        "ppo_vs_grpo: runs=4 failed=0 arithmetic_grpo_pass1=0.600 "
        "arithmetic_ppo_separate_pass1=0.500 arithmetic_mem_ratio=0.400 "
        "arithmetic_best=grpo wall_s=12.5"
    )
    tables = pvg.check_outputs(
        tmp_path, tasks=["arithmetic"], algos=["grpo", "ppo_separate"], seeds=2
    )
    grpo = next(r for r in tables["summary.csv"] if r["algo"] == "grpo")
    assert float(grpo["pass1_final"]) == pytest.approx(0.6, abs=1e-12)
    assert float(grpo["pass1_final_std"]) == pytest.approx(0.1 * 2**0.5, abs=1e-12)  # (0.5, 0.7)
    assert float(grpo["step_s"]) == pytest.approx(0.2, abs=1e-12)
    assert float(grpo["update_s"]) == pytest.approx(0.15, abs=1e-12)
    ppo = next(r for r in tables["summary.csv"] if r["algo"] == "ppo_separate")
    # Seed 1's median would be 10 s with its compiling steps 2 and 3 in it.
    assert float(ppo["step_s"]) == pytest.approx(0.5, abs=1e-12)
    assert len(tables["steps.csv"]) == 16 and len(tables["evals.csv"]) == 8

    def refused(match):
        with pytest.raises(ValueError, match=match):
            pvg.check_outputs(
                tmp_path, tasks=["arithmetic"], algos=["grpo", "ppo_separate"], seeds=2
            )

    steps_csv = (tmp_path / "steps.csv").read_text()
    (tmp_path / "steps.csv").write_text(steps_csv.replace(",0.2,", ",nan,", 1))
    refused("steps.csv row .* is not finite")
    (tmp_path / "steps.csv").write_text(steps_csv)
    table = (tmp_path / "table.md").read_text()
    (tmp_path / "table.md").write_text(
        "\n".join(ln for ln in table.splitlines() if "| ppo_separate |" not in ln)
    )
    refused("table.md: no row for task arithmetic, algo ppo_separate")
    (tmp_path / "table.md").write_text(table)
    (tmp_path / "memory_time.png").unlink()
    refused("memory_time.png")


def test_dot_flops_counts_every_layer_and_agrees_with_xla_where_xla_can_count():
    """`benchlib.dot_flops` (the roofline's FLOP count) against a hand count of the model's
    matmuls, and against XLA's `cost_analysis()` on a one-layer model, where the layer scan
    runs once and XLA's count (which also includes elementwise work) is exact."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    bl = _load("benchlib")
    n, t = 2, 16
    c = bl.TINY_QWEN2
    d, f, q, k, h, v = (c[x] for x in ("hidden_size", "intermediate_size", "num_heads",
                                       "num_kv_heads", "head_dim", "vocab_size"))  # fmt: skip
    per_layer = 2 * n * t * (d * q * h + 2 * d * k * h + q * h * d + 3 * d * f)
    per_layer += 2 * 2 * n * q * t * t * h  # scores and the weighted sum of values
    head = 2 * n * t * d * v

    def count(layers):
        model = bl.tiny_qwen2_model(num_layers=layers)
        graphdef, state = nnx.split(model)

        def fwd(state, tokens):
            m = nnx.merge(graphdef, state)
            return m.logits(m(tokens)[0])

        args = (state, jnp.zeros((n, t), jnp.int32))
        ours = bl.dot_flops(jax.make_jaxpr(fwd)(*args))
        xla = jax.jit(fwd).lower(*args).compile().cost_analysis()
        xla = xla[0] if isinstance(xla, list) else xla
        return ours, xla["flops"]

    assert bl.dot_flops(jax.make_jaxpr(jnp.dot)(jnp.ones((3, 4)), jnp.ones((4, 5)))) == 120
    ours1, xla1 = count(1)
    ours4, _ = count(4)
    assert ours1 == per_layer + head
    assert ours4 == 4 * per_layer + head
    # XLA counts the same matmuls plus norms, softmax, RoPE and SiLU: a few percent more.
    assert ours1 <= xla1 <= 1.1 * ours1, (ours1, xla1)

    # While loops: every loop `while_trips` times, or one count per loop that runs matmuls
    # (a loop without matmuls, here the second, takes none), and a count too many is refused.
    x, w = jnp.ones((3, 4)), jnp.ones((4, 4))

    def loop(n, f, x):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, f(c[1])), (0, x))[1]

    def loops(x, w):
        x = loop(2, lambda x: x @ w, x)
        x = loop(2, lambda x: x + 1.0, x)
        return loop(5, lambda x: (x @ w) @ w, x)

    jaxpr = jax.make_jaxpr(loops)(x, w)
    one = 2 * 3 * 4 * 4
    assert bl.dot_flops(jaxpr, while_trips=7) == 7 * one + 7 * 2 * one
    assert bl.dot_flops(jaxpr, while_trips=[2, 5]) == 2 * one + 5 * 2 * one
    with pytest.raises(ValueError, match="more counts than the program has matmul loops"):
        bl.dot_flops(jaxpr, while_trips=[2, 5, 1])


def test_matmuls_groups_a_programs_matmuls_and_the_floor_loop_runs_each_one():
    """`benchlib.matmuls` (what `bench_roofline` and `bench_sampler` time alone): identical
    matmuls are one entry with their runs summed over loops, `minus` leaves the runs one
    program adds to another, and the timed loop computes the product `runs` times."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    bl = _load("benchlib")
    x, w, v = jnp.ones((3, 4)), jnp.ones((4, 4)), jnp.ones((4, 6))

    def loop(n, f, x):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, f(c[1])), (0, x))[1]

    def program(x, w, v):
        x = loop(2, lambda x: x @ w, x)
        x = jax.lax.scan(lambda c, _: ((c @ w) @ w, None), x, None, length=3)[0]
        return x @ v

    found = bl.matmuls(jax.make_jaxpr(program)(x, w, v), while_trips=[5])
    by_shape = {bl.describe(m): m.runs for m in found.values()}
    assert by_shape == {
        "[3,4] x [4,4] -> [3,4] float32": 5 + 3 * 2,
        "[3,4] x [4,6] -> [3,6] float32": 1,
    }
    assert bl.total_flops(found) == 11 * 2 * 3 * 4 * 4 + 2 * 3 * 4 * 6
    assert bl.total_flops(found) == bl.dot_flops(jax.make_jaxpr(program)(x, w, v), while_trips=[5])

    fewer = bl.matmuls(jax.make_jaxpr(program)(x, w, v), while_trips=[2])
    rest = bl.minus(found, fewer)
    assert [(bl.describe(m), m.runs) for m in rest.values()] == [
        ("[3,4] x [4,4] -> [3,4] float32", 3)
    ]
    with pytest.raises(ValueError, match="runs a matmul more often"):
        bl.minus(fewer, found)

    (m,) = bl.matmuls(jax.make_jaxpr(jnp.dot)(jnp.ones((8, 16)), jnp.ones((16, 5)))).values()
    m = bl.Matmul(m.eqn, 7)
    run, (a, b) = bl.matmul_loop(m)
    np.testing.assert_allclose(run(a, b), 7 * np.sum(np.asarray(a) @ np.asarray(b)), rtol=1e-5)
    total, rows = bl.matmul_floor({"k": m}, repeats=2)
    assert rows[0][0] is m and total == rows[0][1] > 0


_HLO = """HloModule m

%fc.1 (param_0: f32[4,256,512], param_1: s32[]) -> f32[256,512] {
  %param_0 = f32[4,256,512]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic-slice.1 = f32[1,256,512]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c)
  ROOT %bitcast.1 = f32[256,512]{1,0} bitcast(%dynamic-slice.1)
}

%fc.2 (param_0: f32[4,2,64], param_1: s32[], param_2: f32[32,256]) -> f32[32,256] {
  %param_0 = f32[4,2,64]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %dynamic-slice.2 = f32[1,2,64]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c)
  %param_2 = f32[32,256]{1,0} parameter(2)
  ROOT %add.1 = f32[32,256]{1,0} add(%param_2, %param_2)
}

%fc.3 (param_0: f32[32,256], param_1: f32[256,512]) -> f32[32,512] {
  %param_0 = f32[32,256]{1,0} parameter(0)
  %param_1 = f32[256,512]{1,0} parameter(1)
  ROOT %dot.1 = f32[32,512]{1,0} dot(%param_0, %param_1)
}

ENTRY %main (w: f32[4,256,512], b: f32[4,2,64], i: s32[], x: f32[32,256]) -> f32[32,512] {
  %w = f32[4,256,512]{2,1,0} parameter(0)
  %b = f32[4,2,64]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %x = f32[32,256]{1,0} parameter(3)
  %ds_fusion = f32[256,512]{1,0} fusion(%w, %i), kind=kLoop, calls=%fc.1
  %add_fusion = f32[32,256]{1,0} fusion(%b, %i, %x), kind=kLoop, calls=%fc.2
  ROOT %ynn_fusion = f32[32,512]{1,0} fusion(%add_fusion, %ds_fusion), kind=kCustom, calls=%fc.3
}
"""


def test_optimeline_charges_each_instant_once_and_reads_op_kinds_from_the_hlo():
    """`optimeline`: op kinds from HLO text (a fusion holding a dot is a matmul; one that is
    mostly a dynamic slice of a bigger array is a slice copy, one that only reads a small
    slice on the way is not), and the exclusive charging of a traced interval, checked
    against a hand count."""
    tl = _load("optimeline")
    kinds = tl.op_categories(_HLO)
    assert kinds["ynn_fusion"] == tl.MATMUL
    assert kinds["ds_fusion"] == tl.SLICE
    assert kinds["add_fusion"] == tl.OTHER  # 128 sliced elements for a 8192-element result
    with pytest.raises(ValueError, match="no while instruction"):
        tl.loop_body(_HLO, "while.9")

    # matmul [0, 10), slice [5, 20), other [12, 25) and [-3, 1) (clipped), interval [0, 30):
    # [0, 10) matmul (slice beside it 5-10), [10, 12) slice alone, [12, 25) other (slice
    # beside it 12-20), [25, 30) nothing.
    ops = [(0, 10, "mm"), (5, 15, "sl"), (12, 13, "ot"), (-3, 4, "ot")]
    kind = {"mm": tl.MATMUL, "sl": tl.SLICE, "ot": tl.OTHER}.get
    got = tl.attribute(ops, 0, 30, kind)
    assert got == {tl.MATMUL: 10, tl.OTHER: 13, tl.SLICE: 2, tl.IDLE: 5, tl.HIDDEN: 13}

    # A loop of 10 us with a 6 us op after it, steps 20 us apart, three in a call; a second
    # call much later. Steps: the three within-call gaps, not the gap between the calls.
    events = []
    for t in (0, 20, 40, 1000, 1020):
        events += [
            {"ph": "X", "name": "while.1", "ts": t, "dur": 10},
            {"ph": "X", "name": "mm", "ts": t + 1, "dur": 8},
            {"ph": "X", "name": "ThunkExecutor::Execute", "ts": t, "dur": 19},
            {"ph": "X", "name": "ot", "ts": t + 12, "dur": 6},
        ]
    got = tl.step_breakdown(events, "while.1", kind)
    assert got["steps"] == 3
    assert got["step"] == {tl.MATMUL: 8, tl.OTHER: 6, tl.SLICE: 0, tl.IDLE: 6, tl.HIDDEN: 0}
    assert dict(got["ops"]) == {"mm": 8, "ot": 6}


def test_optimeline_finds_the_matmul_and_the_slice_copy_of_a_compiled_layer_scan():
    """On this backend's own HLO: a scan over stacked weights slices each layer's weight and
    multiplies by it; the names `op_categories` gives those two kinds are the compiled
    program's instructions (what a profiler trace names)."""
    import jax
    import jax.numpy as jnp

    tl = _load("optimeline")

    def layers(x, w):
        return jax.lax.scan(lambda x, wl: (jnp.tanh(x @ wl), None), x, w)[0]

    hlo = jax.jit(layers).lower(jnp.ones((8, 64)), jnp.ones((3, 64, 64))).compile().as_text()
    kinds = tl.op_categories(hlo)
    (loop,) = re.findall(r"(while[\w.-]*) = .* while\(", hlo)
    body = {name: kinds[name] for name in tl.loop_body(hlo, loop)}
    assert tl.MATMUL in body.values() and tl.SLICE in body.values()


def test_distill_quick_run_prints_the_gains_line(tmp_path):
    """`experiments/studies/distill.py --quick`: teacher, the three methods from one warm start, and
    a last line of five floats (the figures of so short a run mean nothing)."""
    proc = subprocess.run(
        [sys.executable, str(_script("distill")), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    names = ("distill_gain", "sft_gain", "grpo_gain", "teacher_success", "student_start")
    m = re.fullmatch(r"distill: " + " ".join(rf"{n}=(\S+)" for n in names), out[-1])
    assert m, out[-1]
    values = [float(v) for v in m.groups()]
    assert all(v == v for v in values), out[-1]  # no NaN
    assert any("identical across methods" in line for line in out), proc.stdout[-3000:]


def test_driver_equivalence_reports_what_differs_and_not_the_clock(tmp_path):
    """`experiments/studies/driver_equivalence.py`'s comparison: equal runs whose wall-clock figures
    and folders differ compare equal; a changed array leaf or metric is named."""
    import json

    import jax.numpy as jnp

    from grpojax.driver.checkpoint import Checkpointer

    eq = _load("driver_equivalence")

    def run(name, w, reward, seconds):
        d = tmp_path / name
        with Checkpointer(d / "checkpoints", async_save=False) as ckpt:
            state = {"w": jnp.asarray(w, jnp.float32)}
            ckpt.save(2, state, {"step": 2, "config": {"log": {"run_dir": str(d)}}}, force=True)
        line = {"step": 2, "reward_mean": reward, "time/generate": seconds, "elapsed_s": seconds}
        (d / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        return d

    a = run("a", [1.0, 2.0], 0.5, 1.0)
    assert eq.compare_runs(a, run("b", [1.0, 2.0], 0.5, 7.0)) == []
    diffs = eq.compare_runs(a, run("c", [1.0, 2.5], 0.25, 1.0))
    assert any(d.startswith("metrics line 0: reward_mean 0.5 vs 0.25") for d in diffs), diffs
    assert any(d.startswith("checkpoint state/w") for d in diffs), diffs


def test_profile_decode_slots_quick_run_prints_the_tables_and_the_last_line():
    """`experiments/bench/profile_decode_slots.py --quick` (issue 60's decode profile, T 96, 16
    rows, 8 and 16 slots): the engine's decode steps equal the host schedule's, each slot
    count has a row in every table, the traced categories of a step are positive, and the last
    line carries the keys the results README quotes (the figures of so short a run mean
    nothing)."""
    proc = subprocess.run(
        [sys.executable, str(_script("profile_decode_slots")), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=_script("profile_decode_slots").parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    assert out[0].startswith("machine: ") and "cores" in out[0], out[0]
    assert "model 30m" in out[1] and "33.6M params" in out[1], out[1]
    runs = [re.search(r"slots (\d+): .* (\d+) steps \(schedule (\d+)\)", ln) for ln in out]
    runs = [m.groups() for m in runs if m]
    assert [s for s, _, _ in runs] == ["8", "16"], proc.stdout[-3000:]
    assert all(a == b for _, a, b in runs), runs  # the host schedule is the engine's
    head = next(i for i, ln in enumerate(out) if ln.split()[:3] == ["slots", "steps", "live"])
    table = [ln.split() for ln in out[head + 1 : head + 3]]
    assert [r[0] for r in table] == ["8", "16"] and all(len(r) == 14 for r in table), table
    assert float(table[0][7]) == 1.0  # step x against the first slot count
    cats = next(i for i, ln in enumerate(out) if ln.split()[:3] == ["slots", "w-mm", "attn-mm"])
    for ln in out[cats + 1 : cats + 3]:
        cells = [float(x) for x in ln.split()[1:]]
        assert len(cells) == 11 and cells[-2] > 0 and all(c >= 0 for c in cells), ln
    keys = ("t", "rows", "arch", "step_ms_8", "step_ms_16", "tok_ms_8", "tok_ms_16")
    keys += ("tok_ratio_8", "tok_ratio_16", "fastest_slots", "worst_pair", "grew_most", "cores")
    m = re.fullmatch(r"profile_decode_slots: " + " ".join(rf"{k}=(\S+)" for k in keys), out[-1])
    assert m, out[-1]
    assert m.group(1) == "96" and m.group(2) == "16" and m.group(8) == "1.00", out[-1]


def test_remat_estimate_matches_the_compiled_long_steps():
    """`kept_projection_bytes` (what `model.remat=auto` decides on) against XLA's own
    figures: for every size, length and layout of the committed `plan_memory.py --long
    --remats full,dots_no_batch` table, the estimate is 0.9-1.1x the scratch memory
    dots_no_batch adds over full remat on fsdp 8 and 0.9-1.2x on fsdp 4 x tensor 2 (the
    step's forward: one 1,024 + T row a device on fsdp 8, two on fsdp 4 x tensor 2; the
    estimate errs high there, toward full remat: 1.02-1.17x)."""
    from grpojax.models.config import kept_projection_bytes

    plan = _load("plan_memory")
    table = (EXPERIMENTS / "results/long_context_cpu/plan_memory_long.txt").read_text()
    temp = {}
    row = r"^(\S+)\s+(\d+) (fsdp8|fsdp4_tp2)\s+(full|dots_no_batch)\s+[\d.]+\s+([\d.]+)"
    for m in re.finditer(row, table, re.M):
        temp[m.groups()[:4]] = float(m.group(5))
    ratios = []
    for (size, t, layout, remat), full_gb in temp.items():
        if remat != "full":
            continue
        tensor = plan.LAYOUTS[layout]["tensor"]
        tokens = (1024 + int(t)) * tensor  # 8 rows a forward over 8 / tensor data shards
        config = plan.model_config(plan.ARCHS[size])
        est = kept_projection_bytes(config, tokens, tensor) / 1e9
        ratios.append(
            ((size, t, layout), est / (temp[(size, t, layout, "dots_no_batch")] - full_gb))
        )
    assert len(ratios) == 18, ratios
    assert all(0.9 <= r <= (1.1 if k[2] == "fsdp8" else 1.2) for k, r in ratios), ratios


def test_tool_use_seeds_reads_finished_runs_into_the_table_and_the_last_line(tmp_path):
    """`experiments/studies/tool_use_seeds.py --run-dirs` on two finished runs (the committed
    summaries and metrics of the tool-use result folder, seeds 0 and 1): one table row per
    seed with the summaries' evaluations, and the last line's gains computed from them."""
    import json
    import shutil

    results = EXPERIMENTS / "results" / "tool_use_cpu"
    dirs = []
    for seed in (0, 1):
        d = tmp_path / f"seed{seed}"
        d.mkdir()
        shutil.copy(results / f"seed{seed}_summary.json", d / "summary.json")
        shutil.copy(results / f"seed{seed}_metrics.jsonl", d / "metrics.jsonl")
        (d / "config.yaml").write_text(f"seed: {seed}\n")
        dirs.append(str(d))
    proc = subprocess.run(
        [sys.executable, str(_script("tool_use_seeds")), "--run-dirs", *dirs],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    summaries = [json.loads((results / f"seed{s}_summary.json").read_text()) for s in (0, 1)]
    gains = [s["eval_after"]["pass@1"] - s["eval_before"]["pass@1"] for s in summaries]
    for seed, s in zip((0, 1), summaries):
        row = next(ln.split() for ln in out if ln.split()[:1] == [str(seed)])
        assert float(row[1]) == round(s["eval_before"]["pass@1"], 3), row
        assert float(row[2]) == round(s["eval_after"]["pass@1"], 3), row
    m = re.fullmatch(
        r"tool_use_seeds: seeds=0,1 gain_min=(\S+) gain_mean=(\S+) mean1_gain_min=(\S+) "
        r"before_max=\S+ after_min=\S+ commit=unknown",
        out[-1],
    )
    assert m, out[-1]
    assert float(m.group(1)) == round(min(gains), 3)
    assert float(m.group(2)) == round(sum(gains) / 2, 3)
    mean1 = [s["eval_after"]["mean@1"] - s["eval_before"]["mean@1"] for s in summaries]
    assert float(m.group(3)) == round(min(mean1), 3)


def test_bench_partial_quick_run_prints_the_table_and_the_last_line():
    """`bench_partial.py` on a small workload: both engines timed on the same rounds; the
    partial engine's utilisation is at least the continuous engine's (its slots do not
    drain)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(_script("bench_partial")),
            *("--prompts", "2", "--group", "4", "--slots", "3", "--max-new-tokens", "48"),
            *("--calls", "3", "--warmup", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=_script("bench_partial").parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    number = r"[0-9.]+"
    fields = (
        "continuous_tok_s", "partial_tok_s", "ratio", "util_continuous", "util_partial",
        "ms_step_continuous", "ms_step_partial",
    )  # fmt: skip
    assert re.fullmatch("bench_partial: " + " ".join(f"{f}={number}" for f in fields), last), last
    values = dict(kv.split("=") for kv in last.split(": ")[1].split())
    assert float(values["util_partial"]) >= float(values["util_continuous"])


def test_bench_fused_step_quick_run_checks_the_fused_steps_sites_and_prints_the_last_line():
    """`bench_fused_step.py --quick` at one length: both steps timed, the fused step's
    compiled program holds fused attention sites only (the script exits otherwise), and the
    last line holds the speedup and scratch ratio."""
    script = _script("bench_fused_step")
    proc = subprocess.run(
        [sys.executable, str(script), "--quick", "--lengths", "64", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=script.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"bench_fused_step: speedup_64=[0-9.]+ temp_ratio_64=[0-9.]+", last), last
