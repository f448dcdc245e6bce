"""``--help`` that an 80-column terminal shows whole.

Rich's option panels lay flags, metavars, help and environment variables out as table columns
and, when the terminal is narrow, cut the long ones short (``--upstream-capa…``): a user could not
copy a flag or an environment variable name from the help. The CLI uses click's plain formatter
instead, which wraps help text between words and never shortens a name, and ``SectionedCommand``
keeps rich's grouping: each option's ``rich_help_panel`` becomes a section of its own.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand


class SectionedCommand(TyperCommand):
    """Options grouped under their ``rich_help_panel`` (in order of first appearance); those
    without one under ``default_section``, first."""

    default_section = "Options"

    # click's types, which typer vendors in recent releases: Any keeps this to typer's API
    def format_options(self, ctx: Any, formatter: Any) -> None:
        args: list[tuple[str, str]] = []
        sections: dict[str, list[tuple[str, str]]] = {self.default_section: []}
        for param in self.get_params(ctx):
            rec = param.get_help_record(ctx)
            if rec is None:
                continue
            if param.param_type_name == "argument":
                args.append(rec)
                continue
            panel = getattr(param, "rich_help_panel", None) or self.default_section
            sections.setdefault(panel, []).append(rec)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        for title, recs in sections.items():
            if recs:
                with formatter.section(title):
                    formatter.write_dl(recs)
