"""Whether `entmtp bench --render` reproduces published reports: each report.md given is rendered again from
its results.json in memory and compared with the file, once what a re-render is meant to change is set aside
(the legend paragraph, the probe ms column a report written before it lacks, and the machine's name, which a
run without the hardware record now calls unknown). Prints SAME or the first differing lines per report.

    .venv/bin/python docs/results/rerender_check.py $(grep -rl "probe included" docs/results)
"""

from __future__ import annotations

import argparse
import difflib
import json
from pathlib import Path

from entmtp.bench.report import _images, markdown, task_label

LEGEND = "Speedup = tokens/s over plain decoding"


def comparable(text: str, drop_probe: bool) -> list[str]:
    """The report's lines without the legend, the machine's name, and (`drop_probe`) the probe ms column."""
    out, probe = [], None
    for line in text.splitlines():
        if line.startswith(LEGEND):
            continue
        if " threads, " in line and " new tokens, T=" in line:
            line = line[line.index(" threads, ") :]  # the machine's name goes; the thread count stays
        if line.startswith("| method"):
            cells = line.split(" | ")
            probe = cells.index("probe ms") if "probe ms" in cells else None
        if drop_probe and probe is not None and line.startswith("|"):
            cells = line.split("|")
            del cells[probe + 1 if not line.startswith("|---") else 1]
            line = "|".join(cells)
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path, help="published report.md (or X-report.md) files")
    reports = ap.parse_args().reports
    same = 0
    for report in reports:
        results = report.with_name(report.name.removesuffix("report.md") + "results.json")
        data = json.loads(results.read_text())
        old = report.read_text()
        new = markdown(
            data, {t: task_label(t) for t in data["summary"]}, data["meta"]["command"], _images(old)
        )
        a, b = comparable(old, False), comparable(new, True)
        if a == b:
            same += 1
            print(f"SAME {report}")
        else:
            print(f"DIFF {report}")
            print("\n".join(list(difflib.unified_diff(a, b, lineterm="", n=0))[:12]))
    print(f"{same} of {len(reports)} reproduced")


if __name__ == "__main__":
    main()
