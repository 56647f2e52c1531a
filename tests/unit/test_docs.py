"""The docs stay true to the code: docs/flags.md is what tools/gen_flags.py writes from the config metadata today,
the README is a front page (at most 200 lines, the 8B walkthrough on its first screen), and every link, module
path and file name the docs mention exists. A doc that silently drifts from the code is worse than none.

tests/cli/test_readme.py runs the walkthrough's commands themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import types
from pathlib import Path

import pytest

from threed.cli.flags import add_run_flags
from threed.config import SECTIONS, Meta, field_meta

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "threed"
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "tools" / "convert_hf" / "README.md"]


def load_gen_flags() -> types.ModuleType:
    """tools/gen_flags.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_flags", ROOT / "tools" / "gen_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_md_is_current():
    gen = load_gen_flags()
    assert gen.FLAGS_MD.read_text() == gen.render(), (
        "docs/flags.md is stale: the config's fields changed; run `make docs` (tools/gen_flags.py) and commit it"
    )


def test_a_changed_field_help_makes_flags_md_stale(monkeypatch, tmp_path):
    """Staleness is caught: a field's help reworded in the config (as a developer would) gives another file, and
    `gen_flags.py --check` exits 1 on the old one."""
    gen = load_gen_flags()
    current = tmp_path / "flags.md"
    current.write_text(gen.render())
    assert gen.main(["--check", "--out", str(current)]) == 0

    f = next(f for f in dataclasses.fields(SECTIONS["train"]) if f.name == "seq_length")
    reworded = dataclasses.replace(field_meta(f), help="tokens per sequence, reworded")
    monkeypatch.setattr(f, "metadata", types.MappingProxyType({"threed": reworded}))
    assert "tokens per sequence, reworded" in gen.render()
    assert gen.main(["--check", "--out", str(current)]) == 1
    gen.main(["--out", str(current)])  # `make docs` mends it
    assert gen.main(["--check", "--out", str(current)]) == 0


def test_a_new_field_makes_flags_md_stale(monkeypatch):
    """A field added to a section is a row the file lacks."""
    gen = load_gen_flags()
    before = gen.render()
    cls = dataclasses.make_dataclass(
        "MetricsConfig",
        [("brand_new_knob", int, dataclasses.field(default=3, metadata={"threed": Meta(help="a new knob")}))],
        bases=(SECTIONS["metrics"],),
        frozen=True,
    )
    monkeypatch.setitem(SECTIONS, "metrics", cls)
    after = gen.render()
    assert after != before and "| `--brand-new-knob` |" in after


def test_flags_md_lists_every_option_the_parser_has():
    """Every option string of `threed train` (names and Megatron aliases) is in docs/flags.md: one row per field."""
    p = argparse.ArgumentParser()
    add_run_flags(p)
    options = {o for a in p._actions for o in a.option_strings} - {"-h", "--help", "--model"}
    text = (ROOT / "docs" / "flags.md").read_text()
    missing = sorted(o for o in options if f"`{o}`" not in text)
    assert not missing, f"docs/flags.md lacks {missing}: run `make docs`"
    rows = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert len(re.findall(r"^\| `--", text, re.M)) == rows


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200: move detail to docs/"


def test_readme_first_screen_is_the_8b_walkthrough():
    first = "\n".join(README.read_text().splitlines()[:40])
    assert "## Train Llama 3.1 8B on your cluster" in first
    for step in (
        "make venv",
        "threed preprocess ",
        "make convert HF=",
        "cp recipes/llama31_8b.sh",
        "THREED_DRY_RUN=1",
        "recipes/launch.sh",
        "sbatch ",
        "threed report ",
        "make export CKPT=",
    ):
        assert step in first, f"the README's first 40 lines lack the walkthrough's `{step}`"
    assert first.count("```") >= 2, "the walkthrough's code block must close within the first 40 lines"


def test_doc_links_point_at_files():
    bad = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (page.parent / target).exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def code_spans(text: str) -> list[str]:
    """The `inline code` of a Markdown text, outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose)


def module_file(parts: list[str]) -> Path | None:
    for base in (SRC.parent.joinpath(*parts).with_suffix(".py"), SRC.parent.joinpath(*parts, "__init__.py")):
        if base.exists():
            return base
    return None


def dotted_name_exists(name: str) -> bool:
    """threed.a.b names a module, or threed.a.b.attr a top-level name of one (def, class or assignment)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(parts[:cut])
        if path is None:
            continue
        if cut == len(parts):
            return True
        attr = re.escape(parts[cut])
        return re.search(rf"^(?:def|class) {attr}\b|^{attr}\s*[:=]", path.read_text(), re.M) is not None
    return False


def file_exists(ref: str) -> bool:
    """A .py named in the docs: under src/threed/ or the repository root, or (a bare name) anywhere in the tree."""
    for expanded in brace_expand(ref):
        if "/" in expanded:
            if not ((SRC / expanded).exists() or (ROOT / expanded).exists()):
                return False
        elif not any(any(d.rglob(expanded)) for d in (SRC, ROOT / "tests", ROOT / "tools", ROOT / "benchmarks")):
            return False
    return True


def brace_expand(ref: str) -> list[str]:
    m = re.search(r"\{([^}]*)\}", ref)
    if not m:
        return [ref]
    return [x for alt in m.group(1).split(",") for x in brace_expand(ref[: m.start()] + alt + ref[m.end() :])]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_module_paths_and_files_exist(page):
    """Module paths (`threed.parallel.partition`) and files (`parallel/staged.py`, `test_memory.py`) in the docs'
    inline code exist: a move or rename in src/ that the docs missed fails here."""
    bad = []
    for span in code_spans(page.read_text()):
        for name in re.findall(r"(?<![\w/.-])threed(?:\.[A-Za-z_]\w*)+", span):
            if not dotted_name_exists(name):
                bad.append(name)
        for ref in re.findall(r"(?<![\w./-])([\w./{},-]+\.py)\b", span):
            if not ref.startswith(".") and not file_exists(ref):
                bad.append(ref)
    assert not bad, f"{page.relative_to(ROOT)} names what does not exist: {sorted(set(bad))}"
