"""The documentation is tested: the site builds strictly (a broken link, a missing
reference or a docstring that does not render fails), relative links resolve as files
(as on GitHub), the config keys the pages name exist, no page tells its history, every
public name has its reference entry, the config reference covers every `RunConfig`
field, every code block of the README and the docs runs (or is checked, for commands),
and the ops' docstring examples pass as doctests.

Code blocks (`DOCS_TEST_RULES` below):
- ```python: run in order, per page, in one namespace, in a temporary directory that is on
  `sys.path`; a block whose first line is `# file: NAME.py` is written there, not run.
- ```bash: each command line must be a `grpojax` command (after `VAR=value` prefixes); it
  is parsed by the CLI and its run config (`--config FILE` and the `key=value` overrides)
  loaded and validated, not run. A block that cannot run in the suite (other programs,
  several processes, a full run) is preceded by `<!-- docs-test: skip REASON -->`.
- ```yaml: loaded as a run-config file.
- ```text: output, not run. A block with another language, or none, is an error.
"""

from __future__ import annotations

import doctest
import importlib
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
REFERENCE = {  # module -> its reference page
    "grpojax": "ops",
    "grpojax.models": "models",
    "grpojax.train": "train",
    "grpojax.sampling": "sampling",
    "grpojax.rewards": "rewards",
    "grpojax.envs": "envs",
}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
SKIP = re.compile(r"<!-- docs-test: skip (.*?) -->\s*$")
LANGUAGES = ("python", "bash", "yaml", "text")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once with `mkdocs build --strict` into a temporary directory."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def _canonical(obj) -> str:
    """The defining path of a function or class (the anchor of a page naming it in full)."""
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


@pytest.mark.slow
def test_site_builds_strictly_with_every_public_name_referenced(site):
    for module, page in REFERENCE.items():
        html = (site / "reference" / page / "index.html").read_text(encoding="utf-8")
        mod = importlib.import_module(module)
        missing = [
            name
            for name in mod.__all__
            if not name.startswith("__")
            and f'id="{module}.{name}"' not in html
            and f'id="{_canonical(getattr(mod, name))}"' not in html
        ]
        assert not missing, f"reference/{page}.md lacks {missing}"
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / nb.stem / "index.html").is_file(), nb.name


def test_config_reference_covers_every_field():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        hooks = importlib.import_module("hooks")
    finally:
        sys.path.remove(str(ROOT / "docs"))
    import dataclasses

    from grpojax.config import RunConfig

    text = hooks.config_reference_markdown()
    # Committed as generated (GitHub shows the file; `python docs/hooks.py` refreshes it).
    page = hooks.CONFIG_PAGE.read_text()
    assert hooks.with_config_reference(page) == page, "run `python docs/hooks.py`"

    def fields(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            yield prefix + f.name
            if dataclasses.is_dataclass(value):
                yield from fields(value, prefix + f.name + ".")

    keys = list(fields(RunConfig()))
    assert len(keys) > 150
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, missing
    assert "| `grpo.beta` | `float` | `0.04` |" in text  # a default, rendered
    assert "| `dapo` |" in text and "clip_high=0.28" in text  # a preset's difference


def test_relative_links_resolve_as_files():
    """A page's relative links name files that exist next to it, so they work on GitHub's
    file view as on the site (whose strict build checks them too); code blocks aside."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    broken = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for m in link.finditer(text):
            path = m.group(1).split("#")[0]
            if not path or re.match(r"^[a-z]+:", path):
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {m.group(1)}")
    assert not broken, broken


# Words of a lab diary: a page says what is, with dates; how it got there is the changelog's
# (and the result READMEs', which record how their figures were reached). Relative days;
# "now", "no longer", "used to" (not "is used to"), "supersede(s|d)", "before/after the
# fix", "was kept because", issue numbers and "the issue's", "gone since", "older code",
# "code before", "before ... existed", "while/when ... still". Matched across line breaks.
HISTORY_WORDS = re.compile(
    r"\b(?:today|yesterday|tonight|this (?:morning|afternoon|evening|session)|"
    r"the same (?:morning|afternoon)|last session|that day's session|"
    r"(?<!\bfor )(?<!\bright )(?-i:now)|"
    r"no longer(?! than)|"
    r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )(?<!\bwas )(?<!\bwere )used to|"
    r"supersed(?:e|es|ed|ing)|"
    r"(?:before|after|until|since) (?:the|this|that|a|its) (?:[\w`-]+ )?(?:fix|rewrite|refactor)|"
    r"(?:was|were) kept because|"
    r"issues? #?\d+|(?:the|this|that) issue's|"
    r"gone since|since then|previously|formerly|"
    r"(?:older|earlier|previous|the old|the new) code|code before|"
    r"before [^.]{0,40}existed|(?:while|when) [^.]{0,40}still|(?:was|were) still"
    r")\b",
    re.I,
)
HISTORY_EXEMPT = {ROOT / "docs" / "changelog.md"}  # history by design, as are experiments/results/


def history_told(text: str) -> list[tuple[int, str]]:
    """(line, words) of each match of HISTORY_WORDS in `text`, its whitespace runs read as
    one space so that a phrase broken over lines (or indented) is found."""
    flat, where = [], []
    for m in re.finditer(r"\s+|\S+", text):
        if m.group(0)[0].isspace():
            flat.append(" ")
            where.append(m.start())
        else:
            flat.append(m.group(0))
            where.extend(range(m.start(), m.end()))
    return [
        (text.count("\n", 0, where[m.start()]) + 1, m.group(0))
        for m in HISTORY_WORDS.finditer("".join(flat))
    ]


@pytest.mark.parametrize(
    ("text", "flagged"),
    [
        ("It is 2x faster today.", True),
        ("The test now checks their growth.", True),
        ("the state no longer\n    stores it", True),
        ("the variance the critic used to absorb", True),
        ("These supersede the older table.", True),
        ("before the excess-precision fix it was 0.27", True),
        ("Unmerged was kept\n  because the sampler", True),
        ("(issue 55)", True),
        ("against the issue's targets", True),
        ("measured on older code", True),
        ("(measured through `jax.nn`, before the `fused`\n    backend existed)", True),
        ("taken while the YAML still set bf16", True),
        ("the SFT warm start before RL", False),
        ("the weights before the update", False),
        ("a row no longer than T tokens", False),
        ("PPO as it is used to fine-tune models", False),
        ("Now run the job; refused for now.", False),
        ("an older version of the weights, within k steps", False),
        ("the old policy's logprobs", False),
    ],
)
def test_history_words_tell_narration_from_use(text, flagged):
    """The history check's words flag a page's narration and leave the same words' ordinary
    uses alone."""
    assert bool(history_told(text)) is flagged, history_told(text)


def test_no_page_tells_its_own_history():
    """No page but the changelog narrates its history ("today", "now", "no longer",
    "supersedes", "before the fix", "issue 55", ...): a measurement carries its date and
    result file, and how a figure was reached is in its result README or the changelog."""
    told = []
    for page in PAGES:
        if page in HISTORY_EXEMPT:
            continue
        for line, words in history_told(page.read_text()):
            told.append(f"{page.relative_to(ROOT)}:{line}: {words!r}")
    assert not told, told


# Pages of measurements: each figure's result file is in the repository.
MEASUREMENT_PAGES = [
    *sorted((ROOT / "docs" / "performance").glob("*.md")),
    ROOT / "docs" / "experiments" / "ppo-vs-grpo.md",
    ROOT / "docs" / "tutorials" / "real-model.md",
]
RESULTS = ROOT / "experiments" / "results"
RESULT_PATH = re.compile(r"experiments/results/[\w.*/-]*")
RESULT_FILE = re.compile(r"`([\w./-]+\.(?:txt|csv|json|jsonl|png))`")  # `run1.txt`, `x/y.txt`


def test_measurement_pages_link_their_results():
    """Each measurement page links at least one result under `experiments/results/`; every
    `experiments/results/...` path it links or names exists (a `*` matching one), and so does
    every result file it names in short (`sampler.txt`, `gpu_h100/sampler_0.5b.txt`)."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    names = {p.name for p in RESULTS.rglob("*")}
    wrong = []
    for page in MEASUREMENT_PAGES:
        text = page.read_text()
        where = page.relative_to(ROOT)
        linked = []
        for m in link.finditer(FENCE.sub("", text)):
            if not re.match(r"^[a-z]+:", m.group(1)):
                target = (page.parent / m.group(1).split("#")[0]).resolve()
                if target.is_relative_to(RESULTS):
                    linked.append(target)
        if not linked:
            wrong.append(f"{where}: links no result under experiments/results/")
        wrong += [f"{where}: {t.relative_to(ROOT)} is missing" for t in linked if not t.exists()]
        for m in RESULT_PATH.finditer(text):
            path = m.group(0).rstrip(".")
            if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                wrong.append(f"{where}: {path} does not exist")
        for m in RESULT_FILE.finditer(text):
            name = m.group(1)
            if not name.startswith("experiments/") and not (
                (RESULTS / name).is_file() if "/" in name else name in names
            ):
                wrong.append(f"{where}: no result file {name}")
    assert not wrong, wrong
    assert len(MEASUREMENT_PAGES) > 5


# Inline names that look like config keys but are not (files, a module path).
NOT_CONFIG_KEYS = {"model.safetensors", "model.safetensors.index.json"}


def test_config_keys_named_on_the_pages_exist():
    """Every `section.key` (or `section.key=value`) a page names in inline code, for a
    `RunConfig` section, is a key a config takes (a dict field such as `env.kwargs` takes
    any sub-key); a page may name a module of the same name (`grpojax.sampling.x` is
    written in full)."""
    import dataclasses

    from grpojax.config import RunConfig

    cfg = RunConfig()
    sections = {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if dataclasses.is_dataclass(getattr(cfg, f.name))
    }

    def exists(obj, parts) -> bool:
        for part in parts:
            if isinstance(obj, dict):
                return True
            if not dataclasses.is_dataclass(obj) or part not in {
                f.name for f in dataclasses.fields(obj)
            }:
                return False
            obj = getattr(obj, part)
        return True

    names = "|".join(sections)
    key = re.compile(rf"`((?:{names})\.[A-Za-z_][\w.]*)(?:=[^`]*)?`")
    wrong = []
    for page in PAGES:
        for m in key.finditer(page.read_text()):
            name = m.group(1).rstrip(".")
            section, *rest = name.split(".")
            if name not in NOT_CONFIG_KEYS and not exists(sections[section], rest):
                wrong.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    assert not wrong, wrong


def _blocks(text: str):
    """`(language, code, skip_reason or None, line)` for each fenced block of a page."""
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        line = text.count("\n", 0, m.start()) + 1
        yield m.group(1), m.group(2), (skip.group(1) if skip else None), line


def _commands(code: str) -> list[list[str]]:
    """The command lines of a bash block, `\\`-continuations joined, comments dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words:
            out.append(words)
    return out


def _check_command(words: list[str], where: str) -> None:
    """Parse a `grpojax` command line and load its run config, as the CLI would."""
    from grpojax import cli

    assert words[0] == "grpojax", (
        f"{where}: `{' '.join(words)}` is not a grpojax command; precede the block with "
        "<!-- docs-test: skip REASON --> if it cannot run in the suite"
    )
    try:
        args = cli._parser().parse_args(words[1:])
    except SystemExit as e:
        raise AssertionError(f"{where}: the CLI refuses `{' '.join(words)}`") from e
    if args.command in ("train", "sft", "rm"):
        config = args.config
        if config is not None and (ROOT / config).is_file():
            config = str(ROOT / config)
        cli.load_run_config(config, list(args.overrides))
    elif args.command == "eval":
        cli.load_run_config(None, list(args.overrides))


def _page_id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    from grpojax.config import load_config

    text = page.read_text(encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    try:
        for lang, code, skip, line in _blocks(text):
            where = f"{_page_id(page)}:{line}"
            assert lang in LANGUAGES, f"{where}: a ```{lang} block; use one of {LANGUAGES}"
            if skip is not None:
                assert skip.strip(), f"{where}: a skipped block needs its reason"
                continue
            if lang == "python":
                first = code.split("\n", 1)[0].strip()
                if first.startswith("# file:"):
                    name = first.removeprefix("# file:").strip()
                    (tmp_path / name).write_text(code, encoding="utf-8")
                    written.append(pathlib.Path(name).stem)
                    continue
                exec(compile(code, where, "exec"), namespace)
            elif lang == "bash":
                for words in _commands(code):
                    _check_command(words, where)
            elif lang == "yaml":
                (tmp_path / "block.yaml").write_text(code, encoding="utf-8")
                load_config(tmp_path / "block.yaml")
    finally:
        for name in written:  # another page may write a module of the same name
            sys.modules.pop(name, None)


def test_a_broken_command_in_a_block_is_caught():
    """The checker is not a no-op: a renamed field or a bad value fails."""
    with pytest.raises(Exception, match="no_such_field"):
        _check_command(["grpojax", "train", "grpo.no_such_field=1"], "here")
    with pytest.raises(AssertionError, match="not a grpojax command"):
        _check_command(["pip", "install", "grpojax"], "here")
    blocks = list(_blocks("<!-- docs-test: skip two hosts -->\n```bash\nsrun x\n```\n"))
    assert blocks == [("bash", "srun x\n", "two hosts", 2)]


OPS_MODULES = sorted(
    f"grpojax.ops.{p.stem}" for p in (ROOT / "grpojax" / "ops").glob("*.py") if p.stem != "__init__"
)


@pytest.mark.parametrize("module", OPS_MODULES)
def test_ops_docstring_examples(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{module}: {result.failed} of {result.attempted} examples failed"


def test_every_public_op_has_an_example():
    import grpojax.ops as ops

    finder = doctest.DocTestFinder(recurse=False)
    without = [
        name
        for name in ops.__all__
        if callable(getattr(ops, name))
        and not any(t.examples for t in finder.find(getattr(ops, name), name))
    ]
    assert not without, f"public ops without a docstring example: {without}"
