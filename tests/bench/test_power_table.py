"""benchmarks/diag/power_table.py: phases from a soak log lined up with an nvidia-smi log."""

from __future__ import annotations

import pytest

from benchmarks.diag import power_table as pt


def _write(tmp_path):
    log = tmp_path / "soak.log"
    log.write_text("noise\n"
                   "soak op fold:16:16:8: 1000 calls from 10:00:00.000 to 10:00:02.000 UTC, 2.000 ms per call\n"
                   "soak tile gemm on 132 SMs: 2000 calls from 10:00:02.000 to 10:00:04.000 UTC, 1.000 ms\n"
                   "soak tile gemm on 116 SMs: 1000 calls from 10:00:04.000 to 10:00:06.000 UTC, 2.000 ms\n"
                   "soak comm fold:16:16:8 N=256: 2000 calls from 10:00:06.000 to 10:00:08.000 UTC, 1 ms\n"
                   "soak idle: 1 calls from 10:00:08.000 to 10:00:10.000 UTC, 2000.000 ms per call\n")
    lines = ["timestamp, index, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], temp"]
    # per phase: a lagging first second (ignored with skip 1) and steady samples after
    steady = {0: (1400, 700.0), 2: (1600, 650.0), 4: (1700, 500.0), 6: (1900, 300.0), 8: (345, 100.0)}
    for t0, (mhz, w) in steady.items():
        for i in range(20):
            t = t0 + i * 0.1
            lag = i < 10
            for gpu in (0, 1):
                lines.append(f"2026/11/30 10:00:{t:06.3f}, {gpu}, {1 if lag else mhz} MHz, 3201 MHz, "
                             f"{5000.0 if lag else w + gpu * 2} W, 40")
    lines.append("2026/11/30 10:00:09.999, 0, [N/A], 3201 MHz, [N/A], 40")
    smi = tmp_path / "smi.csv"
    smi.write_text("\n".join(lines) + "\n")
    return str(log), str(smi)


def test_phase_medians_skip_the_lagging_start(tmp_path):
    log, smi = _write(tmp_path)
    phases = pt.read_phases(log)
    assert [p[0] for p in phases] == ["op fold:16:16:8", "tile gemm on 132 SMs", "tile gemm on 116 SMs",
                                      "comm fold:16:16:8 N=256", "idle"]
    rows, gpus = pt.table(phases, pt.read_samples(smi), skip=1.0)
    assert gpus == [0, 1]
    by = {r["phase"]: r for r in rows}
    assert by["op fold:16:16:8"]["W0"] == 700.0 and by["op fold:16:16:8"]["W1"] == 702.0
    assert by["op fold:16:16:8"]["MHz0"] == 1400 and by["idle"]["W0"] == 100.0
    assert by["tile gemm on 132 SMs"]["ms"] == pytest.approx(1.0)


def test_main_prints_a_row_per_phase(tmp_path, capsys, monkeypatch):
    log, smi = _write(tmp_path)
    monkeypatch.setattr("sys.argv", ["power_table", log, smi])
    pt.main()
    out = capsys.readouterr().out.splitlines()
    # the op: 701 W mean over both GPUs, 2 ms per call -> 1.402 J; above idle (101 W) 1.200 J
    assert "| op fold:16:16:8 | 2.000 | 700 | 702 | 1400 | 1400 | 1.402 | 1.200 |" in out
    assert sum(line.startswith("| ") for line in out) == 6  # header and 5 phases
