"""``tcprec bench fp8-accuracy`` and ``tcprec tune conv-fwd`` on the GPU at tiny sizes: the JSON they write follows
the results convention, the tuned table loads back, and the tuner never writes a table the kernel would refuse."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from tcprec.cli import app
from tcprec.kernels.triton import conv_fwd as cf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")
ENV = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}


def _run(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_fp8_accuracy_suite(tmp_path):
    out = tmp_path / "fp8.json"
    res = _run("bench", "fp8-accuracy", "--nets", "resnet18", "--batch", 1, "--out", out)
    assert res.exit_code == 0, res.output
    d = json.loads(out.read_text())
    assert d["suite"] == "fp8_accuracy" and d["command"].startswith("tcprec bench fp8-accuracy --nets resnet18")
    assert [(r["net"], r["fp8_accum"]) for r in d["summary"]] == [("resnet18", "fp32"), ("resnet18", "fast")]
    assert len(d["targets"]) == 1 and set(d["per_layer"]) == {"resnet18/fp32", "resnet18/fast"}
    # the promoted accumulator's per-layer error stays within the bound's unit (docs/numerics.md)
    assert all(r["max_err_over_A"] < 1e-2 for r in d["per_layer"]["resnet18/fp32"])


def test_tune_conv_fwd_writes_a_valid_table(tmp_path):
    table = tmp_path / "conv_fwd_tiles.json"
    shutil.copy(cf.TILE_TABLE_PATH, table)
    out = tmp_path / "sweep.json"
    res = _run("tune", "conv-fwd", "--layers", "yolo.conv2", "--batch", 8, "--table", table, "--out", out,
               "--workers", 2, "--warmup-ms", 2, "--rep-ms", 5)
    assert res.exit_code == 0, res.output
    tiles = cf.load_tile_table(table)
    assert tiles["tap"] == cf._TILES["tap"] and tiles["thin"] == cf._TILES["thin"]  # classes not timed: unchanged
    d = json.loads(out.read_text())
    assert d["suite"] == "conv_fwd_tune" and [r["class"] for r in d["summary"]] == ["flat"]
    assert d["summary"][0]["chosen"] == str(list(tiles["flat"]))
    assert json.loads(table.read_text())["flat"]["source"].startswith("tcprec tune conv-fwd")
