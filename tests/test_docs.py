"""Names with one source (rule 11) and citations that lead somewhere (rule 13).

The code cites the design of record as ``docs/design.md, "Section"`` and its own notes as
``[Note: title]``; a note is kept where a line holds its title alone (in a docstring or a
comment), optionally followed by the design section it belongs to. A renamed section or note
leaves citations pointing at nothing: these tests find them. Phase names (the ``<phase>`` of the
metrics) are constants of ``comm/meter.py`` and ``metrics.py``; the calls that take a phase take
one of those, never a string typed again.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from rlhf_paro.comm.meter import PHASES
from rlhf_paro.metrics import COMM_PHASES, INFERENCE, ROLE_PHASES, TRAIN
from rlhf_paro.sharding.schedule import SCHEDULE, TRAINING_PHASES

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"

SECTION_CITE = re.compile(r'design\.md,?\s+"([^"]+)"')
NOTE_CITE = re.compile(r"\[Note:\s+([^\]]+?)\s*\]")
# A note's own line: its title alone, after a comment sign or a docstring's quotes, and maybe the
# design section it belongs to in parentheses.
NOTE_KEPT = re.compile(r'^\s*(?:#\s*|""")?\[Note: ([^\]]+)\]\s*(?:\(.*\))?\s*$', re.M)


def _files() -> list[Path]:
    """The repository's Python, Markdown and YAML files (what git tracks, and new ones), but
    this one, whose patterns are not citations."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split() if name.endswith((".py", ".md", ".yaml"))
            and (ROOT / name).is_file() and name != "tests/test_docs.py"]


def _flat(text: str) -> str:
    """``text`` with its line breaks (and a comment's ``#`` on the next line) as one space: a
    citation may be wrapped."""
    return re.sub(r"[ \t]*\n[ \t]*(?:#[ \t]*)?", " ", text)


def _headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", DESIGN.read_text(), re.M)}


def _citations(pattern: re.Pattern) -> list[tuple[str, str]]:
    return [(str(path.relative_to(ROOT)), re.sub(r"\s+", " ", m.group(1)))
            for path in _files() for m in pattern.finditer(_flat(path.read_text()))]


def test_every_cited_design_section_is_a_heading_of_design_md():
    cited = _citations(SECTION_CITE)
    assert len(cited) > 20  # the pattern finds the citations that are there
    headings = _headings()
    missing = [(file, section) for file, section in cited if section not in headings]
    assert not missing, f"sections cited but not in docs/design.md: {missing}"


# Citations of the README's and docs/benchmarks.md's sections, as (file, pattern).
GUIDES = {ROOT / "README.md": re.compile(r'README,?\s+"([^"]+)"'),
          ROOT / "docs" / "benchmarks.md": re.compile(r'benchmarks\.md,?\s+"([^"]+)"')}


def test_every_cited_readme_or_benchmarks_section_is_a_heading_there():
    # Sections move between the README and docs/benchmarks.md: a citation may name a heading
    # whole or up to its colon ("The demo" for "The demo: conf=grpo_agent_tiny").
    for guide, pattern in GUIDES.items():
        headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", guide.read_text(), re.M)}
        named = headings | {heading.partition(":")[0] for heading in headings}
        cited = _citations(pattern)
        assert cited, f"no citation of {guide.name} found"
        missing = [(file, section) for file, section in cited if section not in named]
        assert not missing, f"sections cited but not headings of {guide.name}: {missing}"


def test_every_cited_note_is_kept_somewhere():
    kept = {title for path in _files() for title in NOTE_KEPT.findall(path.read_text())}
    cited = _citations(NOTE_CITE)
    assert len(cited) > 40 and len(kept) > 20
    missing = [(file, note) for file, note in cited if note not in kept]
    assert not missing, f"notes cited but kept nowhere: {missing}"


def test_the_schedule_and_the_metrics_take_their_phases_from_the_meter():
    # The schedule's rows name the meter's first four phases, in the order of a step.
    assert TRAINING_PHASES == tuple(dict.fromkeys(row.phase for row in SCHEDULE)) == PHASES[:4]
    assert set(COMM_PHASES) <= set(PHASES)
    timed = {phase for phases in ROLE_PHASES.values() for phase in phases}
    assert timed - set(PHASES) == {INFERENCE, TRAIN}


# Calls that take a phase, and where: (position, keyword).
PHASE_ARGUMENTS = {"select": (1, "phase"), "gathered": (0, "phase"), "_metering": (0, "phase"),
                   "timed": (0, "phase"), "_gather_now": (1, "phase"), "gather": (1, "phase"),
                   "record": (0, "phase"), "all_gather": (3, "phase"),
                   "reduce_scatter": (3, "phase"), "all_reduce": (2, "phase")}


def _typed_phases(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, string) of each phase written as a string where a call takes a phase, or where a
    ``.phase`` is compared."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name not in PHASE_ARGUMENTS:
                continue
            position, keyword = PHASE_ARGUMENTS[name]
            given = node.args[position:position + 1] + [k.value for k in node.keywords
                                                         if k.arg == keyword]
            found += [(node.lineno, a.value) for a in given
                      if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "phase" for s in sides):
                found += [(node.lineno, s.value) for s in sides
                          if isinstance(s, ast.Constant) and isinstance(s.value, str)]
    return found


def test_no_phase_is_typed_as_a_string_where_a_phase_is_taken():
    typed = [(str(path.relative_to(ROOT)), line, value)
             for path in sorted((ROOT / "rlhf_paro").rglob("*.py"))
             for line, value in _typed_phases(ast.parse(path.read_text()))]
    assert not typed, f"phases typed as strings instead of comm.meter's or metrics' names: {typed}"
