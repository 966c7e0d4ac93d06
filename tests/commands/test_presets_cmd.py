"""``echo-plan presets``: each section's names padded to its longest, so the columns after them line up."""

from __future__ import annotations

from echo_plan.cli import main


def test_each_section_lines_up_after_its_longest_name(capsys):
    assert main(["presets"]) == 0
    sections: dict[str, list[str]] = {}
    current = ""
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  "):
            sections.setdefault(current, []).append(line)
        else:
            current = line.split(" ")[0]
    models, clusters, stacks = sections["Models:"], sections["Clusters:"], sections["Software"]
    assert len({row.index("B  layers=") for row in models}) == 1  # the parameter count right-aligned after the names
    for rows in (clusters, stacks):  # the second column starts in one place, after the longest name
        starts = {len(row) - len(row.lstrip()[len(row.split()[0]):].lstrip()) for row in rows}
        assert len(starts) == 1 and starts.pop() > max(len(row.split()[0]) for row in rows) + 2
