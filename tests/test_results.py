"""Figures as data: every figure the README, docs and pipeline headers quote states its result
(results/README.md), and docs/benchmarks.md's current results are the ones generated from results/."""

import json
import re
from pathlib import Path

import pytest
from tool_module import tool

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    return tool("results_file")


rf = _tool()


def test_every_quoted_figure_states_its_result():
    assert rf.check() == []


def test_the_readme_and_pipelines_cite_results():
    assert len(rf.citations(ROOT / "README.md")) >= 40
    assert rf.citations(ROOT / "pipelines/longtail_async.yaml")


def test_the_page_is_the_generated_one():
    assert (ROOT / rf.PAGE).read_text() == rf.page_text(), "run: python tools/results_file.py page"


def test_each_result_says_where_it_came_from():
    for name, doc in rf.load_results().items():
        assert doc["name"] == name
        assert {"command", "commit", "machine", "provenance", "result"} <= doc.keys(), name


@pytest.mark.parametrize(("text", "value"), [
    ("1.94x", 1.942), ("1.94x sooner", 1.942), ("0.70", 0.7), ("162 steps", 162.5), ("163", 162.5),
    ("2.13", 2.125), ("+0.52", 0.516), ("1,504", 1504), ("9.9 %", 0.0994), ("19 of 20", 19),
    ("19 of 20", {"successes": 19, "trials": 20, "ci95": [0.764, 0.991]}), ("0.76-0.99", [0.764, 0.991]),
    ("3.4 to 5.6 minutes", [3.4, 5.6]), ("**58.8 s**", 58.8)])
def test_a_figure_states_its_value(text, value):
    assert rf.compare(text, value) is None


@pytest.mark.parametrize(("text", "value"), [
    ("1.95x", 1.942), ("1.9", 1.96), ("162", 162.6), ("19 of 20", 18), ("19 of 20", {"successes": 19, "trials": 21}),
    ("0.76-0.99", [0.764, 0.98]), ("0.76-0.99", 0.76), ("9.9 %", 9.9), ("1.94x", None), ("1.94x", True),
    ("1.94x", {"ratio": 1.942}), ("about 2", 2)])
def test_a_wrong_figure_is_named(text, value):
    assert rf.compare(text, value)


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "pipelines").mkdir()
    doc = {"name": "pair", "command": "python tools/bench_x.py", "commit": "0" * 40, "machine": "m",
           "provenance": "test", "result": {"wall_speedup": 1.942, "ci95": [0.89, 3.244]}}
    (tmp_path / "results/pair.json").write_text(json.dumps(doc))
    return tmp_path


def test_planted_mismatches_fail(tree):
    (tree / "README.md").write_text("async was [1.94x](results/pair.json#wall_speedup) sooner "
                                    "([0.89-3.24](results/pair.json#ci95))\n")
    (tree / "docs/guide.md").write_text("[1.94x](../results/pair.json#wall_speedup)\n")
    (tree / "pipelines/p.yaml").write_text("# [1.94x](results/pair.json#wall_speedup)\nflowrl: 1\n")
    assert rf.check(tree) == []
    (tree / "README.md").write_text("async was [1.95x](results/pair.json#wall_speedup) sooner\n")
    (tree / "docs/guide.md").write_text("[1.94x](../results/gone.json#wall_speedup)\n")
    (tree / "pipelines/p.yaml").write_text("# [1.94x](results/pair.json#speedup)\nflowrl: 1\n")
    problems = rf.check(tree)
    assert len(problems) == 3
    assert "README.md:1: pair.json#wall_speedup: '1.95x' is not 1.942" in problems
    assert any("gone.json, which does not exist" in p for p in problems)
    assert any("pair.json#speedup, which has no such key" in p for p in problems)


def test_the_archive_is_not_checked(tree):
    (tree / "docs/benchmarks-archive.md").write_text("then: [2.5x](../results/pair.json#wall_speedup)\n")
    assert rf.check(tree) == []


def test_save_records_a_line_and_regenerates_the_page(tree):
    (tree / "docs/benchmarks.md").write_text(f"# B\n\n{rf.BEGIN}\n{rf.END}\n\n## Tools\n")
    line = {"wall_speedup": 2.0, "protocol": {"bench": "bench_x", "heldout": True, "commit": "1" * 40, "dirty": False,
                                              "seeds": [1000], "command": "bench_x.py --heldout", "machine": "vm"}}
    rf.save("pair", line, root=tree)
    doc = json.loads((tree / "results/pair.json").read_text())
    assert (doc["commit"], doc["command"], doc["result"]) == ("1" * 40, "bench_x.py --heldout", line)
    page = (tree / "docs/benchmarks.md").read_text()
    assert "| `wall_speedup` | 2.0 |" in page and page.endswith("## Tools\n")
    (tree / "README.md").write_text("[1.94x](results/pair.json#wall_speedup)\n")
    assert rf.check(tree) == ["README.md:1: pair.json#wall_speedup: '1.94x' is not 2.0"]


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_resolve():
    """Every relative markdown link in the README and docs/ names a file that exists and, with
    #anchor, a heading of that file (GitHub's anchors)."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{page.name}: {target}")
    assert broken == []
