"""The ledger of the report's statements, and the checker that holds them to one answer per question.

A statement is one finding's figure or verdict as one place states it: finding (a question of decisions.json, or
a fact), subject (the option), reference (what it is compared with), metric, value, interval, n, verdict, and the
file and anchor where it stands. decisions.json states every finding once (`Ledger.from_decisions`), the figures
report.screen withheld are stated as withheld, and the report writes them all to statements.jsonl. The checker
fails the report where:
- two statements of one finding, subject and metric differ in value, interval or verdict (`check`);
- a verdict lies outside the one vocabulary (decisions.json's `vocabulary`);
- a figure lies beyond its physical bound (measure.bounds) and was not withheld (report.screen);
- a glance line, short or full, says a verdict word that no statement of its question holds (`check_lines`);
- a table's verdict column (report.parts' `says`) states another verdict of a finding, subject and metric than
  decisions.json does (`from_tables`, then `check`: a statement with no figure is held to its verdict alone);
- a claim's reading of a quantity a question decides differs from the question's figure (`from_claims`: a
  statement with no verdict is held to its figures alone);
- a line of prose names an option and says a verdict word its statements do not hold (`check_document`);
- a row of the claims page says a verdict outside the claims' own words (`check_claims_page`).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ... import records
from ...measure.bounds import BOUNDS, violation
from ...measure.stats import NOT_DECIDED

# The words a verdict may be, whole or as its head (measure.stats, report.decisions, advice and generation_modes),
# before a parenthesis or a colon that says more ("not decided at this size (n=1, no 95% interval)").
VERDICTS = {"faster", "slower", "less", "more", "within", "beyond", "worse", "better", "passes", "fails",
            "pays", "baseline", "not measured", "not decided at this size", "not decided", "fails the task gate",
            "not gated", "withheld", "not better", "-"}
_HEAD = re.compile(r"^(same within ±[\d.]+%|[^(:]+?)(?:\s*[(:].*)?$")
# An option's verdicts that are not an axis's: its status against the question's objective, its comparison with
# another option than the baseline.
OPTION_VERDICTS = ("status", "versus_static", "cause")
# A capacity maximum's cause, against its prediction (tables.capacity.capacity_cause).
CAUSES = {"gap", "gap_short", "loaded", "estimator", "none"}
# What a job or cell that measured nothing is, said where its verdict would stand ("unavailable: <reason>": a
# family's QAT width whose torchao kernel is missing).
STATUSES = {"unavailable", "failed", "oom", "timeout", "skipped", "disabled"}


@dataclass(frozen=True)
class Statement:
    finding: str
    subject: str
    metric: str
    value: float | None
    lo: float | None = None
    hi: float | None = None
    n: int | None = None
    verdict: str | None = None
    reference: str | None = None
    file: str = "decisions.json"
    anchor: str = ""
    bound: float | None = None  # a bound another figure sets (the arrival rate of a goodput): measure.bounds


def in_vocabulary(verdict: str | None) -> bool:
    """Whether a verdict is one of the vocabulary's words (its head, where it says more after '(' or ':'); a fact's
    verdict may carry its own words after the head ("not better than the untrained 4-bit base")."""
    if verdict is None:
        return True
    head = _HEAD.match(verdict.strip())
    return bool(head) and (head.group(1).startswith("same within ±") or head.group(1).strip() in VERDICTS | CAUSES | STATUSES
                           or verdict.split(" ")[0] in VERDICTS)


class Ledger:
    """Every statement the report makes of a finding, in the order made."""

    def __init__(self):
        self.statements: list[Statement] = []

    def state(self, finding: str, subject: str, metric: str, axis: dict | None, *, verdict: str | None = None,
              reference: str | None = None, file: str, anchor: str = "") -> None:
        """Record that `file` states `axis` (a decisions axis: value, lo, hi, n, verdict, and the `bound` another
        figure sets) of the finding."""
        if axis is not None:
            self.statements.append(Statement(finding, subject, metric, axis.get("value"), axis.get("lo"),
                                             axis.get("hi"), axis.get("n"), verdict or axis.get("verdict"),
                                             reference, file, anchor, axis.get("bound")))

    def from_decisions(self, made: dict) -> None:
        """decisions.json's statements: every option's axes, status and comparisons of every question, an answer
        not decided, and every fact."""
        for key, q in made["questions"].items():
            said = lambda metric, subject, a, **kw: self.state(key, subject, metric, a, reference=q.get("baseline"),  # noqa: E731
                                                               anchor=key, file="decisions.json", **kw)
            for o in q.get("options", []):
                # by its name, and by the cell it was decided at as its stage's table names it (row_name)
                for subject in filter(None, (o["name"], row_name(q, o))):
                    for metric, a in (o.get("axes") or {}).items():
                        said(metric, subject, a)
                    for field in OPTION_VERDICTS:
                        if isinstance(o.get(field), str):
                            said(field, subject, {"value": None}, verdict=o[field])
                if isinstance(o.get("time"), dict):
                    t = o["time"]
                    said("time_to_target", o["name"], {"value": t.get("time_s"), "lo": t.get("lo"), "hi": t.get("hi"),
                                                       "n": t.get("n")}, verdict=None)
            if q.get("answer") is None and str(q.get("why", "")).startswith("not decided"):
                said("answer", "-", {"value": None}, verdict=q["why"])
            for axis, name in (q["answer"].items() if isinstance(q.get("answer"), dict) else ()):
                if name is None and axis in (q.get("options") or [{}])[0].get("axes", {}):  # no winner on that axis
                    said(f"answer.{axis}", "-", {"value": None}, verdict=NOT_DECIDED)
            for method, m in ((q.get("open_loop") or {}).get("methods") or {}).items():
                said("goodput", method, m.get("best_goodput"), verdict=None)
            self._slo_search(key, q.get("slo_search"))
        for f in made.get("facts", []):
            if isinstance(f, dict) and "fact" in f:
                self.state(f["fact"], f.get("run") or "-", "value", f, anchor="facts", file="decisions.json")

    def _slo_search(self, key: str, o: dict | None) -> None:
        """The SLO search's statements: each subject's highest rate meeting the SLO and its goodput there (held to
        the arrival rate), and each prefix-cache comparison's verdict."""
        for name, x in ((o or {}).get("subjects") or {}).items():
            self.state(key, name, "slo_rate", x["axis"], file="decisions.json", anchor="slo_search")
            self.state(key, name, "goodput", x["goodput"], file="decisions.json", anchor="slo_search")
        for pair, c in ((o or {}).get("caching") or {}).items():
            self.state(key, c["on"], "prefix_caching", {"value": c["ratio"]}, verdict=c["verdict"],
                       reference=f"{pair} cache off", file="decisions.json", anchor="slo_search")

    def from_tables(self, tables: dict, parts: dict) -> None:
        """Each verdict column of each table (report.parts' `Table.says`), row by row: a verdict with no figure, in
        report.md or in details.md where the table goes there."""
        for part in parts.values():
            for table in part.tables:
                frame = tables.get(table.name)
                if frame is None or frame.empty:
                    continue
                for says in table.says:
                    if says.column not in frame.columns:
                        continue
                    for row in frame.to_dict("records"):
                        verdict = row[says.column]
                        if isinstance(verdict, str) and verdict not in ("-", ""):
                            self.statements.append(Statement(
                                says.finding, says.subject.format_map({k: _cell(v) for k, v in row.items()}),
                                says.metric, None, verdict=verdict, file="details.md" if table.details else "report.md",
                                anchor=table.name))

    def from_claims(self, claims: list[dict]) -> None:
        """The claims' readings of a quantity a question of decisions.json decides (CLAIMED): its figure and
        interval, with no verdict (a claim's verdicts are the claims page's own words), held equal to the
        question's."""
        for r in readings(claims):
            if found := claimed(r):
                self.statements.append(Statement(*found, r["value"], r["lo"], r["hi"], file="claims.md",
                                                 anchor=r["id"]))

    def withheld(self, figures: list[dict]) -> None:
        """The figures report.screen withheld as beyond their bounds: stated as withheld, with no value."""
        for w in figures:
            self.statements.append(Statement(f"{w['stage']}.{w['metric']}", f"{w['job']} {w['where']}", w["metric"],
                                             None, verdict="withheld", file="report.md", anchor="withheld"))

    def write(self, path: Path) -> None:
        path.write_text("".join(json.dumps(asdict(s), default=_plain) + "\n" for s in self.statements))


# The claims' metric kinds that read a figure a question decides, in its units: (question, the metric's field that
# names the option, the axis).
CLAIMED = {"inference_speedup": ("inference", "variant", "speed"), "serving_ratio": ("serving", "method", "speed")}


def readings(claims: list[dict]) -> list[dict]:
    """The measured claims' readings of the claims records that measured something (claims.stage.readings)."""
    return [r for job in records.ok(claims) for r in job.get("readings", [])]


def claimed(reading: dict) -> tuple[str, str, str] | None:
    """(question, option, axis) of decisions.json that a claim's reading reads (CLAIMED), or None."""
    question, field, axis = CLAIMED.get(reading["metric"].get("kind"), (None, None, None))
    option = reading["metric"].get(field) if field else None
    return (question, option, axis) if option else None


# A question compared at one cell of its stage's grid (attention: mode, sequence length, batch), or an option decided
# at one concurrency (serving): how the option at it is named, as its table's `says` names the row.
CELL = "{name} {mode} L={seq_len} B={batch}"
AT = "{name} at {concurrency}"


def row_name(question: dict, option: dict) -> str | None:
    if isinstance(question.get("cell"), dict):
        return CELL.format(name=option["name"], **question["cell"])
    if option.get("concurrency") is not None:
        return AT.format(name=option["name"], concurrency=option["concurrency"])
    return None


def _agree(a: str | None, b: str | None) -> bool:
    """Two verdicts that say the same, one perhaps with more of why after its head ('not decided: the machine's
    speed changed' and the same with the rounds that changed it)."""
    if a is None or b is None or a == b:
        return True
    short, long = sorted((a, b), key=len)
    return long.startswith(short) and long[len(short):len(short) + 2] in (": ", " (")


def _cell(value):
    """A table cell as a subject names it: a whole number without '.0' (pandas makes an int column float where a
    row has none)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _plain(x):
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def check(statements: list[Statement]) -> list[str]:
    """What makes the statements contradict each other or the world: one line per problem, none when they hold."""
    problems, first = [], {}
    for s in statements:
        key = (s.finding, s.subject, s.metric)
        if key in first:
            f = first[key]
            figures = f.value is None or s.value is None or (_same(f.value, s.value) and _same(f.lo, s.lo)
                                                               and _same(f.hi, s.hi))
            if not (figures and _agree(f.verdict, s.verdict)):
                problems.append(f"{s.finding} {s.subject} {s.metric}: {s.file}#{s.anchor} states "
                                f"{_said(s)} where {f.file}#{f.anchor} states {_said(f)}")
        else:
            first[key] = s
        if not in_vocabulary(s.verdict):
            problems.append(f"{s.finding} {s.subject} {s.metric}: verdict {s.verdict!r} ({s.file}#{s.anchor}) is "
                            "outside the vocabulary")
        why = violation(s.metric, s.value, s.bound) if s.metric in BOUNDS else None
        if why:
            problems.append(f"{s.finding} {s.subject} {s.metric} ({s.file}#{s.anchor}): {why}")
    return problems


def _said(s: Statement) -> str:
    interval = f" [{s.lo:.4g}, {s.hi:.4g}]" if s.lo is not None and s.hi is not None else ""
    value = "no value" if s.value is None else f"{s.value:.4g}"
    return f"{value}{interval} ({s.verdict})"


# The vocabulary's words as a reader meets them in a line of prose, whole words only.
_WORDS = re.compile(r"\b(faster|slower|within|beyond|pays|passes|fails|not decided at this size|same within ±[\d.]+%)"
                    r"(?![\w-])")


# "none shown within +5% perplexity", "no variant shown both faster than the base and within ...": a question's
# objective, said where no option meets it, not a verdict of one.
_OBJECTIVE = re.compile(r"\b(?:no|none)\b[^.;:]*?\bshown\b[^.;:]*", re.IGNORECASE)
# "A width passes where the whole 95% interval ... is within +5%", "**faster** or **slower** where the 95% interval
# of the ratio ... excludes 1": a rule that defines the words, not a verdict.
_DEFINITION = re.compile(r"[^.;:]*\bwhere (?:the|its|it is) (?:whole|95%|wholly)[^.;:]*")


def stated_words(line: str) -> set[str]:
    """The verdict words a line of the report says, leaving out a question's objective said unmet and a rule that
    defines them."""
    return {m.group(1) for m in _WORDS.finditer(_DEFINITION.sub("", _OBJECTIVE.sub("", line)))}


def _clauses(line: str) -> list[str]:
    """A line cut at '; ', '. ' and ': ' outside parentheses: a parenthesis stays with the clause it qualifies."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(line):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and ch in ";.:" and line[i + 1:i + 2] == " ":
            out.append(line[start:i])
            start = i + 1
    return out + [line[start:]]


def _named_in(clause: str, subjects: list[str]) -> list[str]:
    """The subjects a clause names, a name inside a longer one named too counted once (lora-r8 in lora-r8-gc)."""
    found = [x for x in subjects if x and x != "-" and x in clause]
    return [x for x in found if not any(x != y and x in y and y in clause for y in found)]


def check_document(statements: list[Statement], text: str, file: str) -> list[str]:
    """Each line of prose in `file` (not a table row, not a heading), clause by clause: a clause that names options
    may say only the verdict words those options' statements hold, of any finding, or an answer not decided
    (subject "-"). A table's rows are the ledger's own statements (from_tables); a clause naming no option is a
    rule or a caveat, not a verdict of one."""
    held: dict[str, set[str]] = {}
    for s in statements:
        held.setdefault(s.subject, set()).update(stated_words(s.verdict or ""))
    undecided = held.pop("-", set())
    subjects = sorted(held, key=len, reverse=True)
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(("|", "#")):
            continue
        for clause in _clauses(line):
            named = _named_in(clause, subjects)
            words = stated_words(clause) - undecided if named else set()
            for word in sorted(words - set().union(*(held[x] for x in named))):
                problems.append(f"{file}:{number}: says {word!r} of {', '.join(named)}, which no statement of "
                                f"{'it' if len(named) == 1 else 'them'} holds: {clause.strip()[:120]}")
    return problems


def check_claims_page(text: str, vocabulary: list[str], file: str = "claims.md") -> list[str]:
    """Each row of the claims page's tables with a verdict column says one of the claims' verdicts (`vocabulary`:
    the claims record's, reproduced, differs, ...), whole or as another reading of a sentence ('reading: differs
    (the sentence: ...)'); the claims' readings of a decided figure are held to it by from_claims."""
    problems, column = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if column is None:
            column = cells.index("verdict") if "verdict" in cells else -1
            continue
        if column < 0 or len(cells) <= column or set(cells[column]) <= set("-: "):
            continue
        said = cells[column].removeprefix("reading: ")
        if not any(said.startswith(v) for v in vocabulary):
            problems.append(f"{file}:{number}: verdict {cells[column]!r} is none of the claims' words "
                            f"({', '.join(vocabulary)})")
    return problems


def check_lines(statements: list[Statement], lines: dict[str, str], file: str) -> list[str]:
    """Each line of `file` that answers a finding (`lines`: finding -> its text) may say only the verdict words its
    statements hold, clause by clause: a clause that names options may say only what those options' statements
    hold, any other clause what the finding's hold. A word from anywhere else was decided outside the ledger."""
    held: dict[str, dict[str, set[str]]] = {}
    for s in statements:
        words = stated_words(s.verdict or "")
        by = held.setdefault(s.finding, {})
        by.setdefault(s.subject, set()).update(words)
        by.setdefault("*", set()).update(words)
    problems = []
    for finding, line in lines.items():
        by = held.get(finding, {})
        subjects = sorted((k for k in by if k != "*"), key=len, reverse=True)
        for clause in _clauses(line):
            named = _named_in(clause, subjects)
            # the question's own statements (subject "-": an answer not decided) hold in any clause
            allowed = set().union(by.get("-", set()), *(by[x] for x in named)) if named else by.get("*", set())
            for word in sorted(stated_words(clause) - allowed):
                problems.append(f"{finding} ({file}): says {word!r}" + (f" of {', '.join(named)}" if named else "")
                                + ", which no statement of it holds")
    return problems
