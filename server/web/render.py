"""The UI's Jinja environment (templates in web/templates), its filters, and the page response."""

from __future__ import annotations

import datetime
from pathlib import Path

import jinja2
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Template
from litestar.template.config import TemplateConfig

from server import models
from server.dispatch.lifecycle import EXPERIMENT_FINAL
from server.store.pages import stamp
from server.web import gate
from server.web.gate import WebRequest

WEB = Path(__file__).resolve().parents[2] / "web"
TEMPLATES = WEB / "templates"
STATIC = WEB / "static"
# htmx comes from the npm package that `make setup` installs (package.json pins it).
HTMX = WEB.parent / "node_modules" / "htmx.org" / "dist"


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def duration(seconds: float) -> str:
    """A span a person reads at a glance: 42s, 5m 07s, 3h 12m, 2d 04h."""
    whole = int(abs(seconds))
    days, rest = divmod(whole, 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def ago(moment: datetime.datetime | None) -> str:
    return "never" if moment is None else f"{duration((now() - moment).total_seconds())} ago"


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def size(count: float) -> str:
    """A number of bytes in binary units: 812 B, 37.5 MiB, 4.02 GiB."""
    for scale, unit, spec in ((2**30, "GiB", ".2f"), (2**20, "MiB", ".1f"), (2**10, "KiB", ".1f")):
        if abs(count) >= scale:
            return f"{count / scale:{spec}} {unit}"
    return f"{count:.0f} B"


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        # The report's sections, shared with coop report's page, come from experiment.report's own templates.
        loader=jinja2.ChoiceLoader(
            [jinja2.FileSystemLoader(TEMPLATES), jinja2.PackageLoader("experiment.report", "templates")]
        ),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(duration=duration, ago=ago, stamp=stamp, percent=percent, bytes=size)
    environment.globals["now"] = now
    return environment


def template_config() -> TemplateConfig[JinjaTemplateEngine]:
    return TemplateConfig(instance=JinjaTemplateEngine.from_environment(_environment()))


def page(request: WebRequest, name: str, status_code: int = 200, /, **context: object) -> Template:
    """A whole page; it shows who is signed in and, once, the notice an action left. ``context``: the values the
    template reads."""
    viewer = gate.viewer(request)
    notice = gate.take_notice(request) if viewer is not None else None
    return Template(
        template_name=name,
        context={"viewer": viewer, "reader": gate.signed_in(request) if viewer is None else None, "notice": notice}
        | context,
        status_code=status_code,
    )


def fragment(request: WebRequest, name: str, **context: object) -> Template:
    """A part of a page that htmx polls; pages include the same template, so they work without JavaScript."""
    return Template(template_name=name, context={"viewer": gate.viewer(request), **context})


def experiment_context(experiment: models.Experiment, **context: object) -> dict[str, object]:
    """An experiment page's context: the experiment, ``live`` while it has not ended (the page polls until it has),
    and ``context``."""
    return {"experiment": experiment, "live": experiment.state not in EXPERIMENT_FINAL, **context}


def page_or_live(request: WebRequest, name: str, /, **context: object) -> Template:
    """The page ``name`` or, asked at its ``/live`` path, the part of it that htmx polls (``fragments/NAME``):
    one handler serves both, from the same context."""
    if request.url.path.endswith("/live"):
        return fragment(request, f"fragments/{name}", **context)
    return page(request, name, **context)
