"""Pictures of pipeline schedules (``deepshard.pipe.draw``): the simulator's timeline, one box per pass on
its stage's row, the busiest stage's bubble in the title; SVG written by hand, PNG only with matplotlib."""
from __future__ import annotations

import importlib.util
import xml.dom.minidom
from pathlib import Path

import pytest

from deepshard.pipe.draw import draw_schedule, main, timeline
from deepshard.pipe.schedule import Kind
from deepshard.pipe.simulate import formula_makespan


def test_timeline_has_every_pass_once_without_overlap_on_a_stage() -> None:
    key, result = timeline("1F1B", stages=4, micro_batches=8)
    assert key == "1f1b" and len(result.passes) == 4 * 8 * 2
    for rank in range(4):
        mine = sorted((t.start, t.end) for t in result.passes if t.rank == rank)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(mine, mine[1:]))
        assert sum(e - s for s, e in mine) == pytest.approx(result.busy[rank])
    assert result.makespan == pytest.approx(formula_makespan("1f1b", 4, 8))
    _, zb = timeline("zb-h1", stages=4, micro_batches=8)
    assert {t.kind for t in zb.passes} == {Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}


def test_svg_needs_nothing_and_png_needs_matplotlib(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = draw_schedule("zb-h1", 2, 4, tmp_path / "zb.svg")
    doc = xml.dom.minidom.parse(str(tmp_path / "zb.svg"))
    boxes = [r for r in doc.getElementsByTagName("rect") if r.getElementsByTagName("title")]
    assert len(boxes) == len(result.passes) == 2 * 4 * 3
    assert "bubble" in doc.getElementsByTagName("text")[0].firstChild.data
    with pytest.raises(ValueError, match=r"\.svg or \.png"):
        draw_schedule("1f1b", 2, 4, tmp_path / "x.pdf")
    png = tmp_path / "i.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert main(["interleaved", "--stages", "2", "--micro-batches", "4", "-o", str(png)]) == 2
        assert "needs matplotlib" in capsys.readouterr().err
    else:
        assert main(["interleaved", "--stages", "2", "--micro-batches", "4", "-o", str(png)]) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
