"""`grpojax` on bad input: one line on stderr naming the culprit, exit status 2; a bug keeps
its traceback and says it is one, exit status 1.

The table runs each bad command line as its own process (forked from a warm parent,
`cli_forkserver`, several at a time); every case fails while checking its input, before
anything is compiled.
"""

import json
import pathlib
import shutil

import pytest
from gguf_fixtures import bad_gguf_files

from grpojax import cli
from grpojax.config import save_config
from grpojax.driver.checkpoint import Checkpointer
from grpojax.driver.setup import build_mesh, build_model
from grpojax.driver.trainer import checkpoint_target, make_trainer
from grpojax.rng import run_key

REPO = pathlib.Path(__file__).resolve().parents[1]

# A run on the small model that would train if nothing were wrong; "{model}" and "{run}"
# are filled in per case.
SMALL = [
    "--no-progress",
    "model.source={model}",
    "log.run_dir={run}",
    "data.size=50",
    "rollout.prompts_per_step=2",
    "grpo.group_size=2",
    "sft.steps=0",
    "total_steps=2",
    "optimizer.warmup_steps=1",
    "eval.heldout_size=2",
    "eval.batch_size=2",
]
FILE = ["data.kind=file", "data.path={data}/{file}"]

# (name, argv, substrings the one stderr line must contain). "{x}" fields are paths made by
# the `inputs` fixture; "{run}" is the case's own run directory.
CASES = [
    # the run configuration
    ("config_value", ["train", "grpo.beta=-1"], ["grpo.beta", ">= 0"]),
    ("config_unknown_key", ["train", "grpo.betta=0.1"], ["grpo.betta", "beta"]),
    ("config_choice", ["train", "algo=sarsa"], ["algo", "'ppo'"]),
    ("config_not_key_value", ["train", "total_steps"], ["total_steps", "key=value"]),
    ("config_file_missing", ["train", "--config", "{data}/nope.yaml"], ["nope.yaml", "not found"]),
    ("config_file_unparsable", ["train", "--config", "{data}/bad.yaml"], ["bad.yaml", "parse"]),
    ("config_data_suffix", ["train", "data.kind=file", "data.path=x.csv"], ["data.path", ".jsonl"]),
    # the model directory and its tokenizer
    (
        "model_missing",
        ["train", *SMALL, "model.source={data}/nomodel"],
        ["model.source", "nomodel"],
    ),
    ("model_no_config", ["train", *SMALL, "model.source={noconfig}"], ["config.json", "noconfig"]),
    ("model_type_gpt2", ["train", *SMALL, "model.source={gpt2}"], ["'gpt2'", "'qwen3'", "gpt2/"]),
    ("model_config_json", ["train", *SMALL, "model.source={badjson}"], ["badjson/config.json"]),
    (
        "model_config_key",
        ["train", *SMALL, "model.source={nokey}"],
        ["nokey/config.json", "vocab_size"],
    ),
    (
        "model_no_weights",
        ["train", *SMALL, "model.source={noweights}"],
        ["safetensors", "noweights"],
    ),
    (
        "model_truncated_weights",
        ["train", *SMALL, "model.source={truncated}"],
        ["truncated/model.safetensors"],
    ),
    (
        "model_missing_tensor",
        ["train", *SMALL, "model.source={notensor}"],
        ["notensor", "model.norm.weight", "missing"],
    ),
    (
        "gguf_missing",
        ["train", *SMALL, "model.source={data}/nope.gguf"],
        ["nope.gguf", "not found"],
    ),
    ("gguf_not_gguf", ["train", *SMALL, "model.source={gguf_not_gguf}"], ["not a GGUF file"]),
    ("gguf_truncated", ["train", *SMALL, "model.source={gguf_truncated}"], ["truncated.gguf"]),
    ("gguf_quant_type", ["train", *SMALL, "model.source={gguf_quant_type}"], ["f64.gguf", "F64"]),
    (
        "gguf_no_tokenizer",
        ["train", *SMALL, "model.source={gguf_no_tokenizer}"],
        ["notok.gguf", "no tokenizer"],
    ),
    ("tokenizer_missing", ["train", *SMALL, "model.source={notok}"], ["notok", "tokenizer"]),
    ("tokenizer_broken", ["train", *SMALL, "model.source={badtok}"], ["badtok", "tokenizer"]),
    # data files and rows
    ("data_missing", ["train", *SMALL, *FILE, "data.path={data}/nope.jsonl"], ["nope.jsonl"]),
    ("data_empty", ["train", *SMALL, *FILE], ["empty.jsonl", "empty"], {"file": "empty.jsonl"}),
    (
        "data_bad_line",
        ["train", *SMALL, *FILE],
        ["badline.jsonl", "line 3"],
        {"file": "badline.jsonl"},
    ),
    ("data_not_object", ["train", *SMALL, *FILE], ["list.jsonl", "line 2"], {"file": "list.jsonl"}),
    ("data_bad_json", ["train", *SMALL, *FILE], ["bad.json", "line 2"], {"file": "bad.json"}),
    (
        "data_not_parquet",
        ["train", *SMALL, *FILE],
        ["fake.parquet", "Parquet"],
        {"file": "fake.parquet"},
    ),
    (
        "data_prompt_column",
        ["train", *SMALL, *FILE, "data.prompt_column=question"],
        ["question", "good.jsonl"],
    ),
    (
        "data_template_column",
        ["train", *SMALL, *FILE, "data.template='Q: {{query}}'"],
        ["query", "good.jsonl"],
    ),
    (
        "data_eval_missing",
        ["train", *SMALL, *FILE, "data.eval_path={data}/gone.jsonl"],
        ["gone.jsonl"],
    ),
    ("data_chat_template", ["train", *SMALL, *FILE, "data.chat_template=true"], ["chat_template"]),
    (
        "data_task_unknown",
        ["train", *SMALL, "data.kind=reasoning_gym", "data.name=no_such_task"],
        ["no_such_task"],
    ),
    (
        "prompt_budget",
        ["train", *SMALL, "data.max_prompt_tokens=2"],
        ["max_prompt_tokens=2", "every"],
    ),
    (
        "sft_no_demonstrations",
        ["train", *SMALL, *FILE, "sft.steps=2"],
        ["sft.steps", "'completion'"],
    ),
    (
        "reward_column",
        ["train", *SMALL, *FILE],
        ["numeric_answer", "'answer'"],
        {"file": "noanswer.jsonl"},
    ),
    (
        "reward_unknown",
        ["train", *SMALL, "rewards.names=[no_such_reward]"],
        ["rewards.names", "no_such_reward", "'numeric_answer'"],
    ),
    # devices
    ("mesh_too_large", ["train", *SMALL, "mesh.data=4"], ["mesh.data=4", "device"]),
    # run directories and checkpoints
    (
        "run_dir_is_file",
        ["train", *SMALL, "log.run_dir={data}/good.jsonl"],
        ["log.run_dir", "not a directory"],
    ),
    ("run_dir_has_checkpoints", ["train", *SMALL, "log.run_dir={oldrun}"], ["oldrun", "--resume"]),
    (
        "resume_no_checkpoint",
        ["train", "--resume", "log.run_dir={emptyrun}"],
        ["emptyrun", "no checkpoint to resume"],
    ),
    (
        "resume_no_run_dir",
        ["train", "--resume", "log.run_dir={data}/norun"],
        ["norun", "does not exist"],
    ),
    ("resume_no_runs", ["train", "--resume"], ["--resume", "no run"]),
    (
        "resume_all_corrupt",
        ["train", "--resume", "log.run_dir={corruptrun}"],
        ["corruptrun", "no readable checkpoint"],
    ),
    ("eval_not_a_run", ["eval", "--run-dir", "{data}"], ["not a run directory"]),
    ("eval_no_checkpoint", ["eval", "--run-dir", "{emptyrun}"], ["emptyrun", "no checkpoint"]),
    ("eval_no_such_step", ["eval", "--run-dir", "{oldrun}", "--step", "7"], ["step 7", "[1]"]),
    ("export_not_a_run", ["export", "{data}", "--out", "{run}"], ["not a run directory"]),
    (
        "export_dtype",
        ["export", "{emptyrun}", "--out", "{run}", "--dtype", "float8"],
        ["--dtype", "float8", "'bfloat16'"],
    ),
    ("sft_zero_steps", ["sft", *SMALL], ["sft.steps"]),
    ("rm_pairs_missing", ["rm", *SMALL, "--pairs", "{data}/nopairs.jsonl"], ["nopairs.jsonl"]),
    ("rm_pairs_column", ["rm", *SMALL, "--pairs", "{data}/good.jsonl"], ["good.jsonl", "'chosen'"]),
]


def _copy_model(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def inputs(small_model_dir, tmp_path_factory):
    """Bad inputs of every kind, next to good ones: name -> path."""
    root = tmp_path_factory.mktemp("bad_inputs")
    data = root / "data"
    data.mkdir()
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    good = "".join(json.dumps(r) + "\n" for r in rows)
    (data / "good.jsonl").write_text(good)
    (data / "empty.jsonl").write_text("")
    lines = good.splitlines()
    (data / "badline.jsonl").write_text("\n".join([*lines[:2], lines[2][:-1], *lines[3:]]) + "\n")
    (data / "list.jsonl").write_text(lines[0] + "\n[1, 2]\n")
    (data / "bad.json").write_text('[{"prompt": "1+1=", "answer": "2"},\n {"prompt" "2+2="}]\n')
    (data / "fake.parquet").write_text("not a parquet file\n")
    (data / "noanswer.jsonl").write_text(
        "".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows)
    )
    (data / "bad.yaml").write_text("grpo: {beta: [\n")

    p = {"data": data, "model": small_model_dir}
    p["noconfig"] = _copy_model(small_model_dir, root / "noconfig")
    (p["noconfig"] / "config.json").unlink()
    for name, edit in (
        ("gpt2", lambda c: {**c, "model_type": "gpt2"}),
        ("nokey", lambda c: {k: v for k, v in c.items() if k != "vocab_size"}),
    ):
        p[name] = _copy_model(small_model_dir, root / name)
        cfg = json.loads((p[name] / "config.json").read_text())
        (p[name] / "config.json").write_text(json.dumps(edit(cfg)))
    p["badjson"] = _copy_model(small_model_dir, root / "badjson")
    (p["badjson"] / "config.json").write_text('{"model_type": "qwen3",')
    p["noweights"] = _copy_model(small_model_dir, root / "noweights")
    (p["noweights"] / "model.safetensors").unlink()
    p["truncated"] = _copy_model(small_model_dir, root / "truncated")
    weights = p["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    p["notensor"] = _copy_model(small_model_dir, root / "notensor")
    from safetensors.numpy import load_file, save_file

    tensors = load_file(p["notensor"] / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, p["notensor"] / "model.safetensors", metadata={"format": "pt"})
    p["notok"] = _copy_model(small_model_dir, root / "notok")
    for f in p["notok"].glob("tokenizer*"):
        f.unlink()
    p["badtok"] = _copy_model(small_model_dir, root / "badtok")
    (p["badtok"] / "tokenizer.json").write_text("{ not json")
    (root / "gguf").mkdir()
    for name, (path, _) in bad_gguf_files(root / "gguf").items():
        p[f"gguf_{name}"] = path

    # Run directories: with a checkpoint (an empty step directory is enough to count), with
    # none, and with a real one whose array files are gone.
    for name in ("oldrun", "emptyrun", "corruptrun"):
        run = root / name
        (run / "checkpoints").mkdir(parents=True)
        config = [a.format(model=small_model_dir, run=run) for a in SMALL[1:]]
        cfg = cli.load_run_config(None, config)
        save_config(cfg, run / "config.yaml")
        p[name] = run
    (p["oldrun"] / "checkpoints" / "1").mkdir()
    mesh = build_mesh(cfg)
    trainer = make_trainer(cfg, build_model(cfg, mesh=mesh)[0], mesh)
    arrays, _ = checkpoint_target(trainer, mesh)  # the structure of a real checkpoint
    arrays = arrays.replace(sample_key=run_key(0, "sample"))
    with Checkpointer(p["corruptrun"] / "checkpoints") as ckpt:
        ckpt.save(1, arrays, {"step": 1})
    for f in (p["corruptrun"] / "checkpoints" / "1" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.unlink()
    return p


@pytest.mark.slow
def test_user_errors_are_one_line_naming_the_culprit_exit_2(inputs, cli_server, tmp_path):
    """Every case: exit status 2, one line on stderr naming the culprit, and no run directory
    written."""
    assert len(CASES) >= 25
    calls, expected = [], []
    for name, argv, must, *extra in CASES:
        cwd = tmp_path / name
        cwd.mkdir()
        fields = {k: str(v) for k, v in inputs.items()}
        fields.update(
            {"run": str(cwd / "run"), "file": "good.jsonl", **(extra[0] if extra else {})}
        )
        argv = [a.format(**fields) for a in argv]
        calls.append((argv, cwd, {}))
        expected.append((name, argv[0], [m.format(**fields) for m in must]))
    results = cli_server.run_many(calls, parallel=3)
    failures = []
    for (name, command, must), r in zip(expected, results):
        lines = r.stderr.strip().splitlines()
        ok = (
            r.returncode == 2
            and len(lines) == 1
            and lines[0].startswith(f"grpojax {command}: error: ")
            and all(m in lines[0] for m in must)
            and not (tmp_path / name / "run").exists()
        )
        if not ok:
            failures.append(f"{name}: exit {r.returncode}, wanted {must} in\n{r.stderr}")
    assert not failures, "\n\n".join(failures)


def test_internal_error_keeps_its_traceback_and_says_it_is_a_bug(monkeypatch, capsys):
    import grpojax.jobs.main_job

    def broken(*args, **kwargs):
        raise RuntimeError("an internal invariant broke")

    monkeypatch.setattr(grpojax.jobs.main_job, "main_job", broken)
    assert cli.main(["train", "seed=3"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "Traceback (most recent call last):"
    assert "RuntimeError: an internal invariant broke" in err
    assert err[-1] == (
        "grpojax train: internal error (a bug): please report it with the traceback above"
    )
