"""The report's words live in Jinja2 templates (report/templates/); this fills them from facts computed elsewhere."""
from __future__ import annotations

from functools import cache
from pathlib import Path

from .writing import number, percent

# jinja2 is imported when the first template is rendered: the report's other modules do not need it.
TEMPLATES = Path(__file__).parent / "templates"


def value_text(a: dict | None, unit: str = "", digits: int = 3, signed: bool = False) -> str:
    """An axis as a reader sees it: '+3.4% [+1.2, +5.6]', '1.09 [1.02, 1.15]', '847 MiB' (exact), or the value
    with its n and 'no interval'; 'not measured' without an axis, 'no figure' for an axis measured without one (a
    serving ratio whose bursts the machine's speed change left no stable round)."""
    if not a:
        return "not measured"
    if a["value"] is None:
        return "no figure"
    def said(x: float) -> str:
        if "MiB" in unit:
            return f"{x:,.0f}"
        return percent(x, signed) if unit == "%" else number(x, digits, signed)

    def end(x: float) -> str:
        """An interval's end, with the digits that keep it apart from the verdict's bound (1 for a ratio, 0 for a
        change) where it is not on it: a lower end of 1.0011 is what makes a ratio faster, and '1' would hide it."""
        bound = 0.0 if unit == "%" or signed else 1.0
        text = said(x)
        if "MiB" in unit or abs(x - bound) < 1e-6 or text != said(bound):  # float noise is on the bound
            return text
        for more in range(digits + 1, digits + 6):
            text = number(x, more, signed) if unit != "%" else f"{x:{'+' if signed else ''}.{more - 2}f}"
            if float(text.replace(",", "")) != bound:
                return text
        return said(x)

    v = f"{said(a['value'])}{unit}"
    if a["lo"] is None:
        return v + (f" (n={a['n']}, no interval)" if a.get("n") else "")
    if a["lo"] == a["hi"] == a["value"]:
        return v
    return f"{v} [{end(a['lo'])}, {end(a['hi'])}]"


@cache
def environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True, undefined=jinja2.StrictUndefined, autoescape=False)
    env.filters["v"] = value_text
    env.filters["pct"] = lambda a: value_text(a, "%", 3, signed=True)
    env.filters["mib"] = lambda a: value_text(a, " MiB", 4)
    env.filters["x"] = lambda a: value_text(a, "×", 3)
    env.filters["names"] = lambda xs: ", ".join(f"**{x}**" for x in xs)
    return env


def render(template: str, **facts) -> str:
    return environment().get_template(template).render(**facts)
