"""MkDocs hooks: the pages made from the code at build time, so they cannot drift.

- ``reference/cli.md``: every subcommand's usage and options, rendered from the argparse
  parsers (``mixprec.cli.main.build_parser()``);
- ``policy.md``: the marker ``<!-- mixprec-lists -->`` becomes the output of
  ``mixprec lists --markdown`` for fp16 and for bf16;
- ``bench/results/*.md`` and ``bench/harness.md``: the committed bench results
  (``bench/results/``) and ``bench/README.md``, as pages of the site.

``tests/docs/test_docs.py`` imports this file to check the CLI reference against the
parsers. Nothing here is written into ``docs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_RESULTS = ROOT / "bench" / "results"
LISTS_MARKER = "<!-- mixprec-lists -->"
CLI_PAGE = "reference/cli.md"


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in ``mixprec --help``'s order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    lines: list[str] = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS]
        if not actions:
            continue
        lines += ["", f"**{group.title}**", "", "| argument | meaning |", "|---|---|"]
        for action in actions:
            invocation = formatter._format_action_invocation(action)
            meaning = formatter._expand_help(action) if action.help else ""
            if isinstance(action, argparse._SubParsersAction):
                meaning = "the command: each one has its section below"
            if action.required and action.option_strings:
                meaning = f"required; {meaning}"
            lines.append(f"| `{_cell(invocation)}` | {_cell(meaning)} |")
    return lines


def cli_reference() -> str:
    """The CLI reference page, in Markdown, from the parsers themselves."""
    from mixprec.cli.main import build_parser

    # argparse wraps usage lines at the terminal's width: the same page on every machine
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return _cli_reference(build_parser())
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def _cli_reference(parser: argparse.ArgumentParser) -> str:
    out = [
        "# CLI reference",
        "",
        "Generated at build time from the argparse parsers (`mixprec.cli.main.build_parser()`),",
        "so it lists exactly what `mixprec COMMAND --help` prints. The guides explain when to",
        "use what; exit statuses are in [Troubleshooting](../guides/troubleshooting.md).",
        "",
        "## mixprec",
        "",
        "```text",
        parser.format_usage().rstrip(),
        "```",
        *_options_table(parser),
    ]
    for name, help_text, sub in _subcommands(parser):
        out += ["", f"## mixprec {name}", "", help_text[:1].upper() + help_text[1:] + "."]
        out += ["", "```text", sub.format_usage().rstrip(), "```"]
        out += _options_table(sub)
    return "\n".join(out) + "\n"


def cli_flags() -> dict[str, list[str]]:
    """Every option string of every subcommand (and of ``mixprec`` itself, under "")."""
    from mixprec.cli.main import build_parser

    parser = build_parser()
    flags = {"": [s for a in parser._actions for s in a.option_strings]}
    for name, _, sub in _subcommands(parser):
        flags[name] = [s for a in sub._actions for s in a.option_strings]
    return flags


def lists_markdown() -> str:
    """``mixprec lists --markdown`` for fp16, then for bf16, run in this process."""
    from mixprec.cli.main import main

    parts = []
    for dtype in ("fp16", "bf16"):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            status = main(["lists", "--markdown", "--dtype", dtype])
        if status != 0:
            raise RuntimeError(f"mixprec lists --markdown --dtype {dtype} exited {status}")
        parts.append(f"### {dtype}\n\n" + buffer.getvalue().strip())
    return "\n\n".join(parts)


def bench_pages() -> dict[str, Path]:
    """Site path -> source file of each bench result page (and the bench's README)."""
    pages = {f"bench/results/{p.name}": p for p in sorted(BENCH_RESULTS.glob("*.md"))}
    pages.update({f"bench/results/{p.name}": p for p in sorted(BENCH_RESULTS.glob("*.png"))})
    pages["bench/harness.md"] = ROOT / "bench" / "README.md"
    return pages


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, CLI_PAGE, content=cli_reference()))
    for uri, source in bench_pages().items():
        files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if LISTS_MARKER in markdown:
        markdown = markdown.replace(LISTS_MARKER, lists_markdown())
    return markdown
