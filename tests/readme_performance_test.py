"""The README's performance tables are the committed results files' own, rendered, never retyped."""
from benchmarks import readme


def test_readme_performance_tables_are_rendered_from_the_committed_results():
    assert readme.main(["--check"]) == 0, "run: python benchmarks/readme.py"


def test_a_section_names_the_command_date_machine_and_file(tmp_path, monkeypatch):
    (tmp_path / readme.RESULTS).mkdir(parents=True)
    (tmp_path / readme.RESULTS / "x.json").write_text(
        '{"command": "python benchmarks/x.py", "date": "2026-11-30T15:00:00+00:00", "tables": "## Speed\\n\\n| a |\\n|---|\\n| 1 |",'
        ' "machine": {"cpu_model": "Some CPU", "cpu_flags": ["avx2", "avx512f"], "cpus_usable": 2, "load_avg_1m": 0.1}}')
    monkeypatch.setattr(readme, "REPO", str(tmp_path))
    text = readme.section("x.json", "X")
    assert text.startswith("#### X\n\n`python benchmarks/x.py` — 2026-11-30, Some CPU (avx2, avx512f), 2 cores")
    assert "**Speed**\n\n| a |" in text and "[`benchmarks/results/x.json`](benchmarks/results/x.json)" in text
