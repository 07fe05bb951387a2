"""MkDocs hooks of the grpojax site.

- `reference/config.md` holds the run-config reference between two markers, generated from
  the `RunConfig` dataclasses: every field with its type, its default and the text of its
  class docstring's `Attributes:` entry (a field without an entry fails). It is committed,
  so GitHub's file view shows it and its anchors; the site's build regenerates it, and the
  suite checks the committed text is current. `python docs/hooks.py` rewrites it.
- A page's relative link to a repository file outside `docs/` (a result folder under
  `experiments/results/`, a script) works on GitHub's file view as written; the site does
  not hold those files, so its build writes the link's text unlinked, or a link into the
  repository when `repo_url` is set.
- The notebooks live at the top level (`notebooks/`, beside `experiments/`); the site adds
  them as pages under `notebooks/` (rendered by mkdocs-jupyter), and a page's link to one
  (`../../notebooks/NAME.ipynb`, right on GitHub) becomes a link to its page.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import typing

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

NOTEBOOKS = "notebooks"  # the top-level folder the site publishes under the same name
CONFIG_MARKER = "<!-- config-reference -->"
CONFIG_END = "<!-- /config-reference -->"
CONFIG_PAGE = pathlib.Path(__file__).resolve().parent / "reference" / "config.md"


def with_config_reference(markdown: str) -> str:
    """`markdown` with the text between the markers replaced by `config_reference_markdown`."""
    head, _, rest = markdown.partition(CONFIG_MARKER)
    _, end, tail = rest.partition(CONFIG_END)
    tail = tail if end else "\n"
    body = config_reference_markdown()
    return f"{head}{CONFIG_MARKER}\n\n{body}\n\n{CONFIG_END}{tail}"


@event_priority(100)  # before mkdocs-jupyter's on_files, which renders what it finds
def on_files(files, config):
    """The top-level notebooks added to the site's files as `notebooks/NAME.ipynb`."""
    root = pathlib.Path(config["docs_dir"]).resolve().parent
    for nb in sorted((root / NOTEBOOKS).glob("*.ipynb")):
        uri = f"{NOTEBOOKS}/{nb.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File(uri, str(root), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if CONFIG_MARKER in markdown:
        markdown = with_config_reference(markdown)
    return with_repository_links(
        markdown, pathlib.Path(page.file.abs_src_path), config["docs_dir"], config.get("repo_url")
    )


_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def with_repository_links(markdown: str, page: pathlib.Path, docs_dir, repo_url=None) -> str:
    """`markdown` with each relative link to a file of the repository outside `docs_dir`
    written as its text alone (or as a link into `repo_url`'s tree); code blocks as they are."""
    docs = pathlib.Path(docs_dir).resolve()
    root = docs.parent

    def link(m: re.Match) -> str:
        text, url = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", url) or url.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = url.partition("#")
        target = (page.parent / path).resolve()
        if target.is_relative_to(docs) or not target.is_relative_to(root):
            return m.group(0)
        if target.parent == root / NOTEBOOKS and target.suffix == ".ipynb":  # the site's page
            site = os.path.relpath(docs / NOTEBOOKS / target.name, page.parent)
            return f"[{text}]({pathlib.Path(site).as_posix()}{'#' + anchor if anchor else ''})"
        if not repo_url:
            return text
        rel = target.relative_to(root).as_posix()
        return f"[{text}]({repo_url.rstrip('/')}/blob/HEAD/{rel}{'#' + anchor if anchor else ''})"

    out, pos = [], 0
    for fence in _FENCE.finditer(markdown):
        out.append(_LINK.sub(link, markdown[pos : fence.start()]))
        out.append(fence.group(0))
        pos = fence.end()
    out.append(_LINK.sub(link, markdown[pos:]))
    return "".join(out)


# ----------------------------------------------------------------------------- config reference


def attribute_docs(cls: type) -> dict[str, str]:
    """`{field: text}` from the Google-style `Attributes:` section of `cls`'s docstring.

    An entry `a, b: text` documents both fields; continuation lines are joined.
    """
    doc = cls.__doc__ or ""
    lines = doc.expandtabs().splitlines()
    try:
        start = next(i for i, s in enumerate(lines) if s.strip() == "Attributes:")
    except StopIteration:
        return {}
    entries: dict[str, str] = {}
    indent = None
    names: list[str] = []
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        if indent is None:
            indent = depth
        if depth < indent:
            break
        head = re.match(r"^([A-Za-z_][\w]*(?:\s*,\s*[A-Za-z_][\w]*)*)\s*:\s?(.*)$", line.strip())
        if depth == indent and head:
            names = [n.strip() for n in head.group(1).split(",")]
            for n in names:
                entries[n] = head.group(2).strip()
        elif names:
            for n in names:
                entries[n] = f"{entries[n]} {line.strip()}".strip()
    return entries


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join("..." if a is Ellipsis else _type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _value(v) -> str:
    if isinstance(v, str):
        return f"`{v!r}`" if v == "" else f"`{v}`"
    if isinstance(v, tuple | list):
        return "`[" + ", ".join(str(x) for x in v) + "]`"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    return f"`{v}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(prefix: str, obj, out: list[str], level: int) -> None:
    cls = type(obj)
    docs = attribute_docs(cls)
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    missing = [f.name for f in fields if f.name not in docs]
    if missing:
        raise ValueError(
            f"{cls.__module__}.{cls.__qualname__}: no Attributes entry for {missing} "
            "(the config reference is generated from these docstrings)"
        )
    first = (cls.__doc__ or "").strip().split("\n\n")[0]
    summary = " ".join(line.strip() for line in first.split("\n"))
    title = f"`{prefix}`" if prefix else "Top level"
    out += [f"{'#' * level} {title}", "", f"`{cls.__qualname__}`: {summary}", ""]
    out += ["| field | type | default | what it does |", "| --- | --- | --- | --- |"]
    nested = []
    for f in fields:
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(value):
            nested.append((key, value))
            default = f"see [`{key}`](#{key.replace('.', '')})"
        else:
            default = _value(value)
        out.append(
            f"| `{key}` | `{_cell(_type_name(hints[f.name]))}` | {_cell(default)} "
            f"| {_cell(docs[f.name])} |"
        )
    out.append("")
    for key, value in nested:
        _section(key, value, out, min(level + 1, 4) if prefix else level)


def _presets() -> list[str]:
    from grpojax.config import ALGOS, load_config

    base = load_config().grpo
    out = [
        "## Algorithm presets",
        "",
        "`algo=NAME` puts a preset under the file and the overrides: the `grpo` fields it "
        "sets differently from `algo=grpo` (a value from the file or an override still "
        "wins; fields that follow the completion budget are shown for the default "
        "`rollout.max_new_tokens`).",
        "",
        "| algo | grpo fields set by the preset |",
        "| --- | --- |",
    ]
    for algo in ALGOS:
        teacher = ["distill.teacher=TEACHER"] if algo == "distill" else []
        cfg = load_config(overrides=[f"algo={algo}", *teacher])
        if cfg.is_ppo:
            out.append(f"| `{algo}` | the `ppo` section and a critic; `grpo` gives G only |")
            continue
        diff = [
            f"`{f.name}={_value(getattr(cfg.grpo, f.name)).strip('`')}`"
            for f in dataclasses.fields(base)
            if getattr(cfg.grpo, f.name) != getattr(base, f.name)
        ]
        out.append(f"| `{algo}` | {', '.join(diff) or '(the defaults below)'} |")
    return [*out, ""]


def config_reference_markdown() -> str:
    """The run-config reference: presets, then one table per section of `RunConfig()`."""
    from grpojax.config import RunConfig

    out = _presets()
    _section("", RunConfig(), out, 2)
    return "\n".join(out)


if __name__ == "__main__":
    CONFIG_PAGE.write_text(with_config_reference(CONFIG_PAGE.read_text()))
