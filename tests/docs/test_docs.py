"""The documentation as tests: the site builds strictly, the CLI reference names every flag
of every subcommand, and every code block marked runnable runs against the demo model.

A runnable block is a fenced block whose previous line is ``<!-- run -->`` (every command
exits 0), ``<!-- run exit=N -->`` (every ``mixprec`` command exits N, the others 0) or
``<!-- run requires=MODULE -->`` (skipped when MODULE cannot be imported). A ``text`` block
right after it, marked ``<!-- output -->``, lists lines its output must contain. Each page's
blocks run in order, one command at a time, in one temporary folder holding
``demo_fp32.onnx`` and ``examples/``, with this interpreter's ``mixprec`` and ``python``
first on PATH (see docs/contributing.md).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
#: The pages whose blocks may be runnable: the guides and the README's quickstart.
PAGES = [*sorted(DOCS.rglob("*.md")), REPO_ROOT / "README.md"]

MARKER = re.compile(r"^<!--\s*run\b(?P<args>[^>]*?)\s*-->\s*$")
OUTPUT_MARKER = re.compile(r"^<!--\s*output\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>```+)\s*(?P<lang>[\w-]*)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass
class Block:
    page: Path
    line: int
    commands: list[str]
    exit: int = 0
    requires: str | None = None
    expected: list[str] = field(default_factory=list)


def _fenced(lines: list[str], start: int) -> tuple[list[str], int]:
    """The body of the fenced block opening at ``lines[start]`` and the index after it."""
    fence = FENCE.match(lines[start])
    assert fence is not None
    body = []
    i = start + 1
    while i < len(lines) and not lines[i].startswith(fence["fence"]):
        body.append(lines[i])
        i += 1
    return body, i + 1


def _commands(body: list[str]) -> list[str]:
    """Shell commands of a block: ``\\``-continued lines joined, comments dropped."""
    commands, current = [], ""
    for raw in body:
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        commands.append(current + line)
        current = ""
    if current:
        commands.append(current)
    return commands


def runnable_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if marker is None:
            i += 1
            continue
        j = i + 1
        if j >= len(lines) or not FENCE.match(lines[j]):
            raise AssertionError(f"{page}:{i + 1}: a run marker must stand before a fence")
        args = dict(a.split("=", 1) for a in marker["args"].split() if "=" in a)
        body, after = _fenced(lines, j)
        block = Block(page, j + 1, _commands(body), int(args.get("exit", 0)), args.get("requires"))
        k = after
        while k < len(lines) and not lines[k].strip():
            k += 1
        if k < len(lines) and OUTPUT_MARKER.match(lines[k]):
            out_body, after = _fenced(lines, k + 1)
            block.expected = [line for line in out_body if line.strip()]
        blocks.append(block)
        i = after
    return blocks


RUN_PAGES = [p for p in PAGES if runnable_blocks(p)]


def _load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mixprec_docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_mixprec(command: str) -> bool:
    words = [w for w in shlex.split(command) if not ENV_ASSIGNMENT.match(w)]
    return bool(words) and words[0] == "mixprec"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXPREC_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MIXPREC_THREADS"] = "1"
    return env


def test_pages_have_runnable_blocks() -> None:
    # the marker is found at all (a typo in it would silently run nothing)
    names = {p.relative_to(REPO_ROOT).as_posix() for p in RUN_PAGES}
    assert {"README.md", "docs/guides/convert.md", "docs/guides/quantize.md"} <= names
    assert {"docs/guides/troubleshooting.md"} <= names


@pytest.mark.slow  # every command of every page, each in a subprocess
@pytest.mark.parametrize(
    "page", RUN_PAGES, ids=[p.relative_to(REPO_ROOT).as_posix() for p in RUN_PAGES]
)
def test_runnable_blocks(page: Path, tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(REPO_ROOT / "examples", target_is_directory=True)
    subprocess.run(
        [sys.executable, "examples/make_demo_model.py", "demo_fp32.onnx"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    env = _env()
    for block in runnable_blocks(page):
        where = f"{page.relative_to(REPO_ROOT)}:{block.line}"
        if block.requires and importlib.util.find_spec(block.requires) is None:
            continue  # an extra this environment lacks (make test installs them all)
        output = ""
        for command in block.commands:
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            output += done.stdout + done.stderr
            want = block.exit if _is_mixprec(command) else 0
            assert done.returncode == want, (
                f"{where}: `{command}` exited {done.returncode}, the page says {want}\n"
                f"{done.stdout}\n{done.stderr}"
            )
        for line in block.expected:
            assert _shown(line.strip(), output), f"{where}: output lacks {line!r}:\n{output}"


#: A number in a page's expected output line.
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
#: How far a measured number may sit from the one a page shows (the last printed digit of
#: a rel L2 moves between CPUs and ONNX Runtime's kernels: 0.000115 / 0.000114).
_NUMBER_RTOL = 0.02


def _shown(line: str, output: str) -> bool:
    """``line`` is in ``output``: verbatim, or one output line with the same words and
    every number within :data:`_NUMBER_RTOL` of the page's."""
    if line in output:
        return True
    want_words, want = _NUMBER.split(line), [float(x) for x in _NUMBER.findall(line)]
    for candidate in output.splitlines():
        got = _NUMBER.findall(candidate.strip())
        if _NUMBER.split(candidate.strip()) != want_words or len(got) != len(want):
            continue
        if all(
            abs(float(g) - w) <= _NUMBER_RTOL * max(abs(w), 1e-12)
            for g, w in zip(got, want, strict=True)
        ):
            return True
    return False


def missing_flags(page: str, flags: dict[str, list[str]]) -> dict[str, list[str]]:
    """The flags of each subcommand that its section of the CLI reference page lacks."""
    sections = re.split(r"^## ", page, flags=re.MULTILINE)
    by_command = {s.split("\n", 1)[0].strip(): s for s in sections[1:]}
    missing = {}
    for command, names in flags.items():
        section = by_command.get(f"mixprec {command}".strip(), "")
        lost = [f for f in names if not re.search(rf"`[^`]*(?<![\w-]){re.escape(f)}\b", section)]
        if lost:
            missing[command] = lost
    return missing


def test_cli_reference_names_every_flag() -> None:
    hooks = _load_hooks()
    flags = hooks.cli_flags()  # read from argparse: a new option is checked without edits here
    assert set(flags) - {""} == {
        "convert", "quantize", "optimize", "tune", "inspect", "validate", "lists", "report",
        "batch",
    }  # fmt: skip
    assert "--calibration-data" in flags["convert"] and "--version" in flags[""]
    assert missing_flags(hooks.cli_reference(), flags) == {}


def test_a_flag_left_out_of_the_reference_is_caught() -> None:
    hooks = _load_hooks()
    page = hooks.cli_reference().replace("--eval-data", "--eval-dat")
    assert set(missing_flags(page, hooks.cli_flags())) == {"quantize", "optimize", "batch"}


@pytest.mark.slow  # the whole MkDocs site
def test_site_builds_strictly(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=REPO_ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    hooks = _load_hooks()
    for command, names in hooks.cli_flags().items():
        for flag in names:
            assert flag in cli, f"mixprec {command} {flag} is not on the built CLI page"
    policy = (site / "policy" / "index.html").read_text(encoding="utf-8")
    assert "ConvTranspose" in policy and "decides a count" in policy
    api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in ("mixprec.convert", "mixprec.quantize", "mixprec.tune", "mixprec.batch"):
        assert name in api
    assert (site / "bench" / "results" / "2026-11-25-bf16" / "index.html").is_file()


def test_the_contributing_layout_names_every_module() -> None:
    """docs/contributing.md's layout table names each module of each subpackage, and no
    module that is gone (issue 44: it listed 3 of 6 calibrate modules)."""
    text = (DOCS / "contributing.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_]+)/` \| (.*) \|$", text, re.M))
    package = REPO_ROOT / "src" / "mixprec"
    problems = []
    for folder in sorted(p for p in package.iterdir() if (p / "__init__.py").is_file()):
        row = rows.get(folder.name)
        if row is None:
            problems.append(f"{folder.name}/: no row")
            continue
        named = set(re.findall(r"([A-Za-z0-9_]+)\.py", row))
        files = {f.stem for f in folder.glob("*.py") if f.stem != "__init__"}
        problems += [f"{folder.name}/{m}.py: not named" for m in sorted(files - named)]
        problems += [f"{folder.name}/{m}.py: named, not there" for m in sorted(named - files)]
    assert problems == [], problems
