"""The README's performance tables are the committed results files' own, rendered, never retyped."""

from benchmarks import readme


def test_readme_performance_tables_are_rendered_from_the_committed_results():
    assert readme.main(["--check"]) == 0, "run: python benchmarks/readme.py"


def test_a_section_names_the_command_date_machine_and_file(tmp_path, monkeypatch):
    (tmp_path / readme.RESULTS).mkdir(parents=True)
    (tmp_path / readme.RESULTS / "x.json").write_text(
        '{"command": "python benchmarks/x.py", "date": "2026-11-30T15:00:00+00:00", "tables": "## Speed\\n\\n| a |\\n|---|\\n| 1 |",'
        ' "machine": {"cpu_model": "Some CPU", "cpu_flags": ["avx2", "avx512f"], "cpus_usable": 2, "load_avg_1m": 0.1}}'
    )
    monkeypatch.setattr(readme, "REPO", str(tmp_path))
    text = readme.section("x.json", "X")
    assert text.startswith("#### X\n\n`python benchmarks/x.py` — 2026-11-30, Some CPU (avx2, avx512f), 2 cores")
    assert "**Speed**\n\n| a |" in text and "[`benchmarks/results/x.json`](benchmarks/results/x.json)" in text


def test_the_readmes_one_table_puts_the_command_beside_each_figure():
    rendered = readme.render_readme().split("Reduced precision on CPU")[0]
    rows = [r for r in rendered.splitlines() if r.startswith("| ") and "**" in r]
    assert len(rows) == len([t for t in readme.TARGETS if t[1] not in readme.HISTORY_ONLY | {readme.PRECISION}])
    assert not any(name in row for row in rows for name in readme.HISTORY_ONLY)  # history stays in docs/
    for row in rows:
        assert "`python benchmarks/" in row, row


def test_the_readme_sets_the_precisions_and_runtimes_side_by_side_with_the_command_and_the_gate():
    import json

    record = json.load(open(f"{readme.REPO}/{readme.RESULTS}/{readme.PRECISION}"))
    table = readme.render_readme().split("Reduced precision on CPU")[1]
    from benchmarks.readme_precision import ORDER, display

    head = next(r for r in table.splitlines() if r.startswith("| encoder (CPU)"))
    sides = sorted(record["sides"], key=lambda s: ORDER.index(s["side"]))
    assert head.strip(" |").split(" | ")[1:] == [display(s["side"]) for s in sides]
    assert "docbeam float32, engine auto" in head  # docbeam's chosen engine beside its XLA figures
    speeds = next(r for r in table.splitlines() if r.startswith("| tokens/s"))
    assert speeds.strip(" |").split(" | ")[1:] == [f"{s['tokens_per_s']:,.0f}" for s in sides]
    engines = next(r for r in table.splitlines() if r.startswith("| engine that ran"))
    assert engines.strip(" |").split(" | ")[1] == "xla"  # docbeam float32 is XLA's, whatever auto chose
    gates = next(r for r in table.splitlines() if r.startswith("| precision gate"))
    for side in record["sides"][1:]:  # each verdict is the file's: a failing one names its gate
        assert ("passes" if side["gate"]["passed"] else "; ".join(side["gate"]["failures"])) in gates
    assert f"`{record['command']}`" in table and "precision.json" in table


def test_the_same_command_on_two_machines_is_set_side_by_side(tmp_path, monkeypatch):
    def write(folder, ratio, cpu):
        (tmp_path / readme.RESULTS / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / readme.RESULTS / folder / "encoder-float32.json").write_text(
            f'{{"command": "python benchmarks/encoder.py", "tables": "| t |", "docbeam_over_st": {ratio},'
            f' "docbeam": {{"tokens_per_s": 1}}, "sentence_transformers": {{"tokens_per_s": 1}},'
            f' "lowest_cosine": 1.0, "docs": 4, "pipeline": {{"wall_after_first_batch_tokens_per_s": 1}},'
            f' "machine": {{"cpu_model": "{cpu}"}}}}'
        )

    monkeypatch.setattr(readme, "REPO", str(tmp_path))
    write("", 1.34, "Xeon")
    assert readme.machines_table() == ""  # one machine: nothing to set beside it
    write("amd-epyc", 1.61, "EPYC")
    (row,) = [
        r for r in readme.machines_table().splitlines() if r.startswith("| encoder ÷ sentence-transformers, sample")
    ]
    assert "**1.34** Xeon" in row and "**1.61** EPYC" in row
    assert "(../benchmarks/results/amd-epyc/encoder-float32.json)" in row
