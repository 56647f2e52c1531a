"""The docs stay true to the code: docs/flags.md is what tools/gen_flags.py writes from the config metadata today,
the README is a front page (at most 200 lines, the 8B walkthrough on its first screen), and every link, module
path and file name the docs mention exists: every `--flag` is one a parser takes (threed's, or that of the tool named
beside it), every repository path exists, every `threed.x.y` is a module or a name of one (a moved path only where
the page says it moved). A failure lists each offender as file:line. The README's house and architecture.md's wing
table follow pyproject.toml's wings contract. A doc that silently drifts from the code is worse than none.

tests/cli/test_readme.py runs the walkthrough's commands themselves.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib.util
import re
import tomllib
import types
from pathlib import Path

import pytest

from threed import MOVED
from threed.cli.flags import add_run_flags
from threed.cli.main import parser as threed_parser
from threed.config import SECTIONS, Meta, field_meta

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "threed"
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "tests" / "README.md", *sorted((ROOT / "tools").rglob("README.md"))]


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


# --- Every flag, path and module a page names exists --------------------------------------------------------------
#
# A page is read in units: a fenced code block whole, else a paragraph (a table is one). A name is checked against
# what its unit shows: a flag belongs to a threed parser, or to a tool the same unit names (a script of this
# repository, or one of EXTERNAL's); a path exists in the tree; a dotted threed name is a module or an attribute of
# one, and a path in threed.MOVED counts only where its unit says "moved".

FENCE = re.compile(r"^\s*```")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
ROOTS = ("src", "tests", "tools", "slurm", "recipes", "docs", "benchmarks", ".ci")
PATH_CHARS = r"[\w.{},*$<>/-]"
ROOTED = re.compile(rf"(?<![\w/.$-])((?:{'|'.join(map(re.escape, ROOTS))})/{PATH_CHARS}*)")
# `parallel/pipeline.py` (under src/threed/, or the page's own folder: tests/README.md's `ranks/worker_setup.py`)
BARE_PY = re.compile(r"(?<![\w/.$-])((?:[\w{},*-]+/)*[\w{},*-]+\.py)\b")
DOTTED = re.compile(r"(?<![\w/.-])threed(?:\.[A-Za-z_]\w*)+")
# A name given with its file: "`model/spec.py`'s `PARAMETERS`", "(`parallel/distributed.py`: `a`, `b`)"
IN_FILE = re.compile(r"`((?:\w+/)*\w+\.py)`(?:'s|:)? ((?:`[A-Za-z_][\w.]*`(?:, | and )?)+)")
PLACEHOLDER = re.compile(r"[$<>]")

# Flags of programs outside this repository that the pages show, each accepted only in a unit that names the program.
EXTERNAL = {
    "torchrun": {"--nproc-per-node", "--shutdown-timeout"},
    "sbatch": {"--parsable", "--nodes", "--gres", "--signal"},
    "srun": {"--kill-on-bad-exit"},
    "pip": {"--no-deps", "--no-index", "--target", "--no-build-isolation"},
    "ruff": {"--check"},
    "pytest": {"--dist"},  # pytest-xdist's
    "py-spy": {"--subprocesses", "--rate", "--format"},  # the profiler docs/performance.md's figures came from
}
# Paths a page's own commands create (`cp recipes/llama31_8b.sh recipes/my_recipe.sh`): not in the tree.
CREATED = {"recipes/my_recipe.sh", "recipes/my_8b.sh"}


def units(text: str) -> list[tuple[int, list[str]]]:
    """(number of the first line, lines) of each fenced code block and each paragraph of a Markdown text."""
    out: list[tuple[int, list[str]]] = []
    cur: list[str] = []
    start, fenced = 0, False
    for n, line in enumerate(text.splitlines(), 1):
        fence = bool(FENCE.match(line))
        if not fenced and (fence or not line.strip()):  # a paragraph ends; a code block may open
            if cur:
                out.append((start, cur))
            cur, fenced = [], fence
            if not fence:
                continue
        elif fenced and fence:  # the code block closes
            out.append((start, [*cur, line]))
            cur, fenced = [], False
            continue
        if not cur:
            start = n
        cur.append(line)
    if cur:
        out.append((start, cur))
    return out


@functools.cache
def threed_flags() -> frozenset[str]:
    """Every option string of `threed` and of each of its sub-commands (walked from threed.cli.main.parser())."""
    flags: set[str] = set()
    todo = [threed_parser()]
    while todo:
        p = todo.pop()
        for action in p._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return frozenset(flags)


@functools.cache
def script_flags(path: Path) -> frozenset[str]:
    """The flags a script of this repository takes or passes on: its quoted `--x` strings (Python), every `--x` in
    it (shell, `#SBATCH` lines included)."""
    text = path.read_text()
    if path.suffix == ".py":
        return frozenset(re.findall(r"[\"'](--[a-z][a-z0-9-]*)", text))
    return frozenset(FLAG.findall(text))


def expand(ref: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", ref)
    if not m:
        return [ref]
    return [x for alt in m.group(1).split(",") for x in expand(ref[: m.start()] + alt + ref[m.end() :])]


def path_exists(ref: str, bases: tuple[Path, ...]) -> bool:
    """One brace-expanded path under one of the bases; a glob must match something; a placeholder (`$JOBID`,
    `<model>`) cuts the path to the folders before it."""
    if PLACEHOLDER.search(ref):
        ref = ref[: PLACEHOLDER.search(ref).start()].rpartition("/")[0]
    if "*" in ref:
        return any(any(base.glob(ref)) for base in bases)
    return any((base / ref).exists() for base in bases)


def named_paths(line: str) -> list[str]:
    """The repository paths of a line (src/..., tests/..., `parallel/pipeline.py`, `test_memory.py`), trailing
    punctuation off."""
    rooted = [m.rstrip(".,:;'") for m in ROOTED.findall(line)]
    return rooted + [ref for ref in BARE_PY.findall(line) if not ref.startswith(ROOTS) and ref not in " ".join(rooted)]


def path_ok(ref: str, page: Path) -> bool:
    """A rooted path exists from the repository root; `module/file.py` under src/threed/, the root or the page's
    folder; a bare file name anywhere in the code; each brace alternative."""
    if ref in CREATED:
        return True
    if ref.startswith(ROOTS) or "/" in ref:
        bases = (ROOT,) if ref.startswith(ROOTS) else (SRC, ROOT, page.parent)
        return all(path_exists(x, bases) for x in expand(ref))
    code = (SRC, ROOT / "tests", ROOT / "tools", ROOT / "benchmarks")
    return all(any(any(d.rglob(x)) for d in code) for x in expand(ref))


def unit_flags(unit: str) -> set[str]:
    """The flags a unit may name: threed's, and those of the tools it names (EXTERNAL's, this repository's
    scripts)."""
    known = set(threed_flags())
    known.update(*(flags for tool, flags in EXTERNAL.items() if re.search(rf"\b{re.escape(tool)}\b", unit)))
    for ref in named_paths(unit):
        if ref.startswith(ROOTS) and ref.endswith((".py", ".sh")) and (ROOT / ref).is_file():
            known |= script_flags(ROOT / ref)
    return known


@functools.cache
def module_names(path: Path) -> dict[str, set[str] | None]:
    """A module's top-level names, each with the names of its class body (None: not a class, not looked into)."""
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if hasattr(n, "name")} | {
                t.id if isinstance(t, ast.Name) else t.attr  # a field, or an attribute set on self
                for n in ast.walk(node)
                for t in (
                    n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                )
                if isinstance(t, ast.Name) or (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name))
            }
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({n.id: None for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)})
    return names


def module_file(parts: list[str]) -> Path | None:
    for path in (SRC.parent.joinpath(*parts).with_suffix(".py"), SRC.parent.joinpath(*parts, "__init__.py")):
        if path.exists():
            return path
    return None


def dotted_name_exists(name: str) -> bool:
    """threed.a.b names a module (a file under src/threed, nothing imported), or threed.a.b.attr[.member] a name
    defined or imported at the top of one (and a member of the class it names)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(parts[:cut])
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        names = module_names(path)
        if rest[0] not in names:
            return False
        return len(rest) == 1 or names[rest[0]] is None or rest[1] in names[rest[0]]
    return False


def moved_from(name: str) -> str | None:
    """The MOVED path (src/threed/__init__.py) that `name` is or lies under."""
    return next((old for old in MOVED if name == old or name.startswith(old + ".")), None)


def page_offenders(page: Path, text: str | None = None) -> dict[str, list[str]]:
    """`file:line: name` of each flag, path and threed name of a page (its text, or `text` as if it were there)
    that does not exist."""
    where = page.relative_to(ROOT)
    bad: dict[str, list[str]] = {"flags": [], "paths": [], "modules": []}
    for start, lines in units(page.read_text() if text is None else text):
        unit = "\n".join(lines)
        known = unit_flags(unit)
        for n, line in enumerate(lines, start):
            bad["flags"] += [f"{where}:{n}: {f}" for f in FLAG.findall(line) if f not in known]
            bad["paths"] += [f"{where}:{n}: {ref}" for ref in named_paths(line) if not path_ok(ref, page)]
            bad["modules"] += [f"{where}:{n}: {what}" for what in missing_names(line, page, "moved" in unit)]
    return bad


def missing_names(line: str, page: Path, says_moved: bool) -> list[str]:
    """The threed names of a line that do not exist: `file.py`'s `name`, and dotted `threed.a.b[.attr]`."""
    out = []
    for ref, names in IN_FILE.findall(line):
        path = next((b / ref for b in (SRC, ROOT, page.parent) if (b / ref).is_file()), None)
        out += [f"{x} (not in {ref})" for x in re.findall(r"`([\w.]+)`", names) if path and not_in(x, path)]
    for name in DOTTED.findall(line):
        old = moved_from(name)
        if old and not says_moved:
            out.append(f"{name} (moved to {MOVED[old]})")
        elif not old and not dotted_name_exists(name):
            out.append(name)
    return out


def not_in(name: str, path: Path) -> bool:
    return name.split(".")[0] not in module_names(path)


def all_offenders(pages: list[Path]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"flags": [], "paths": [], "modules": []}
    for page in pages:
        for kind, names in page_offenders(page).items():
            found[kind] += names
    return found


@pytest.fixture(scope="module")
def offenders() -> dict[str, list[str]]:
    return all_offenders(PAGES)


def test_docs_name_only_flags_that_exist(offenders):
    """A `--flag` of a page is a flag of `threed` or one of its sub-commands, or of a script or tool its code block
    or paragraph names (EXTERNAL: torchrun, sbatch, pip, ...)."""
    assert not offenders["flags"], "flags that no parser takes:\n" + "\n".join(offenders["flags"])


def test_docs_name_only_paths_that_exist(offenders):
    """src/..., tests/..., recipes/... and `module/file.py` (under src/threed/) of a page exist in the tree."""
    assert not offenders["paths"], "paths that do not exist:\n" + "\n".join(offenders["paths"])


def test_docs_name_only_modules_that_exist(offenders):
    """`threed.a.b[.attr]` of a page is a module or a name of one; a moved path only where the page says so."""
    assert not offenders["modules"], "threed names that do not exist:\n" + "\n".join(offenders["modules"])


def test_a_wrong_name_planted_in_a_page_is_caught():
    """The checks can fail: a wrong flag (or a tool's flag away from the tool), path, module, name in a module and
    moved module planted in a page are each named with their line; their real neighbours, a moved path the page
    says moved and a path under a placeholder are not."""
    text = "\n".join(
        [
            "# planted",
            "",
            "`threed train --tp 2 --tensor-paralel 2` reads `parallel/pipeline.py` and `parallel/pipelines.py`,",
            "`recipes/llama31_8b.sh`, `slurm/llama8b_tp2_pp3.sh`, `threed.model.spec.pipeline_layers`,",
            "`threed.model.spek` and `threed.parallel.context.share_micro_batch`; `model/spec.py`'s `PARAMETER`,",
            "`model/spec.py`'s `PARAMETERS`, `.ci/run`.",
            "",
            "```bash",
            "sbatch --parsable --nodes=2 slurm/train.sh && torchrun --nproc-per-node 2 x",
            "pip install --no-deps -e .",
            "```",
            "",
            "pip install --parsable",
            "",
            "`threed.planner` moved to `threed.plan.planner`; `slurm/logs/threed-$JOBID/train.log`.",
        ]
    )
    found = page_offenders(ROOT / "docs" / "planted-test-page.md", text)
    where = "docs/planted-test-page.md"
    assert found["flags"] == [f"{where}:3: --tensor-paralel", f"{where}:13: --parsable"]
    assert found["paths"] == [f"{where}:3: parallel/pipelines.py", f"{where}:4: slurm/llama8b_tp2_pp3.sh"]
    assert found["modules"] == [
        f"{where}:5: PARAMETER (not in model/spec.py)",
        f"{where}:5: threed.model.spek",
        f"{where}:5: threed.parallel.context.share_micro_batch (moved to threed.model.context)",
    ]


def contract_wings() -> list[str]:
    """The wings contract's floors, top to bottom, as the pages write them: `verify/ | plan/ | train/`; the floor of
    top-level modules is `top level`."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (wings,) = [c for c in config["contracts"] if c["name"].startswith("threed wings")]
    return [
        "top level" if ":" in floor else " | ".join(m.strip().removeprefix("threed.") + "/" for m in floor.split("|"))
        for floor in wings["layers"]
    ]


def test_the_house_drawings_follow_the_wings_contract():
    """README's house and docs/architecture.md's wing table list the wings contract's floors in its order: moving a
    wing in pyproject.toml without redrawing them fails here."""
    want = contract_wings()
    block = README.read_text().split("## The house", 1)[1].split("```")[1]
    drawn = [re.split(r"\s{2,}", line.strip())[0].strip("()") for line in block.strip().splitlines()]
    assert drawn == want, f"README.md's house draws {drawn}; pyproject.toml's wings contract says {want}"
    table = (ROOT / "docs" / "architecture.md").read_text().split("| floor | wing |", 1)[1]
    rows = re.findall(r"^\| (\d+) \| ([^|]*(?:\\\|[^|]*)*) \|", table, re.M)
    drawn = [wing.replace("`", "").replace("\\", "").strip() for _, wing in rows]
    assert drawn == want, f"docs/architecture.md's wing table lists {drawn}; the wings contract says {want}"
    assert [int(n) for n, _ in rows] == list(range(len(want), 0, -1)), "the floors are numbered top to bottom"
