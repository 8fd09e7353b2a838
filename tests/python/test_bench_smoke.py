"""The benchmarks stay runnable: each family's ``--quick`` run completes in a fresh process
and reports every section it prints (timings are for reading, never asserted), and
``headscope.bench.tables`` turns its JSON into the Markdown of docs/performance.md; the
public timing helpers on known times."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from headscope.bench.tables import cell


@pytest.mark.timeout(960)  # the hf family's run takes minutes; its own limit is 900 s
@pytest.mark.parametrize("family", ["mixer", "vas", "attribution", "hf", "cost"])
def test_quick_benchmark_runs(family, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "headscope.bench", "--family", family, "--quick",
                             "--device", "cpu", "--json", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    results = json.loads(out.read_text())
    sections = results["families"][family]
    assert sections, "no section reported"
    empty = [name for name, rows in sections.items() if not rows]
    assert not empty, f"sections without results: {empty}"
    assert results["date"] and results["machine"] and results["quick"] is True
    check_markdown_tables(family, results, out, tmp_path)


def check_markdown_tables(family, results, source, tmp_path):
    """Every table the run printed is on the page: its title, the measurement's caption,
    the header and each row's numbers, formatted as the benchmark prints them."""
    page_path = tmp_path / "performance.md"
    run = subprocess.run([sys.executable, "-m", "headscope.bench.tables", str(source),
                          "--output", str(page_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    page = page_path.read_text()
    tables = results["tables"][family]
    assert tables, "the run recorded no table"
    assert f"### {family}\n" in page
    assert page.count(results["date"]) == len(tables)  # the caption under every table
    for table in tables:
        assert f"**{table['title']}**" in page
        assert "| " + " | ".join(table["columns"]) + " |" in page
        for row in table["rows"]:
            line = "| " + " | ".join(cell(row.get(c)).replace("|", "\\|")
                                     for c in table["columns"]) + " |"
            assert line in page, f"row missing from the page: {line}"


def test_tables_from_results_without_printed_tables(tmp_path):
    """Results files written before the benchmark recorded its tables: each section's rows
    (a list, the lists of a dict, or one dict) become tables titled by the section."""
    source = tmp_path / "old.json"
    source.write_text(json.dumps({"torch": "2.11.0", "device": "cpu", "machine": "x86_64",
                                  "threads": 2, "families": {"mixer": {
                                      "projection": {"n": 128, "ms": 5.6312, "vs_seed": 19.71},
                                      "mixer_vs_sdpa": {"rows": [{"n": 256, "r": 8, "speedup": 1.2}],
                                                        "growth": [{"T": 128, "MiB": 25.46}],
                                                        "crossover_n": {"8": 256}},
                                      "thin_mix": [{"n": 1024, "what": "a|b", "eager_ms": None}],
                                      "skipped": None}}}))
    run = subprocess.run([sys.executable, "-m", "headscope.bench.tables", str(source)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    page = run.stdout
    assert "**projection**" in page and "| 128 | 5.63 | 19.7 |" in page
    assert "**mixer_vs_sdpa**" in page
    assert "| n | r | speedup |\n| ---: | ---: | ---: |\n| 256 | 8 | 1.2 |" in page
    assert "**mixer_vs_sdpa: growth**" in page and "| 128 | 25.5 |" in page
    assert "| n | what | eager_ms |\n| ---: | --- | --- |\n| 1024 | a\\|b |  |" in page
    assert "skipped" not in page and "crossover" not in page
    assert page.count("_x86_64, 2 CPU threads, torch 2.11.0, file dated ") == 4


def test_tables_refuse_other_json(tmp_path):
    source = tmp_path / "other.json"
    source.write_text("{}")
    run = subprocess.run([sys.executable, "-m", "headscope.bench.tables", str(source)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "is not the output of" in run.stderr


def test_token_clock_and_round_ratios():
    """headscope.timing on known times: the prompt's token, then four decode steps."""
    from headscope.timing import TokenClock, round_ratios
    clock = TokenClock()
    for _ in range(3):
        clock.put(None)
    clock.end()
    assert len(clock.times) == 3 and clock.times == sorted(clock.times)
    clock.times = [10.0, 11.0, 11.5, 12.5, 13.0]
    assert clock.per_token() == pytest.approx(0.5)            # median of 0.5, 1.0, 0.5
    assert clock.mean_per_token() == pytest.approx(2.0 / 3)   # (13 - 11) over 3 steps
    assert round_ratios([2.0, 9.0, 4.0], [1.0, 3.0, 2.0]) == (2.0, 2.0, 3.0)
