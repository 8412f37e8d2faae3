"""bench/int8_matmul: bad flags are refused by name, and a tiny run reports every matmul of a layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.mark.parametrize("argv, flag", [(["--rows", "8,x"], "--rows"), (["--rows", "0"], "--rows"),
                                        (["--reps", "0"], "--reps")])
def test_bad_flags_name_the_flag(argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from bench.int8_matmul import main

    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "r.json")])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_tiny_run_times_each_matmul_and_the_layer(tmp_path: Path):
    from bench.int8_matmul import MATMULS, main

    out = tmp_path / "r.json"
    assert main(["--rows", "4", "--reps", "1", "--out", str(out)]) == 0
    per = json.loads(out.read_text())["rows"]["4"]
    assert set(per) == {*MATMULS, "layer"}
    for variant in ("bf16", "int8_matmul", "int8_quantize"):
        assert per["layer"][variant] == pytest.approx(sum(per[m][variant] for m in MATMULS))
        assert all(per[m][variant] > 0 for m in MATMULS)
