"""conv_fwd's tile table is data (kernels/triton/conv_fwd_tiles.json, decision 0032), loaded and validated once, and
``tcprec tune conv-fwd`` (GPU) rewrites it: the loaded table equals the literal the code held, a broken table is
named, the tuner's choice and its written table round-trip through the loader, and on the CPU the command refuses."""

import json
import math
import shutil

import pytest
import torch
from typer.testing import CliRunner

from tcprec.bench import tune_conv_fwd as tcf
from tcprec.cli import app
from tcprec.kernels.conv_geometry import ConvGeometry as G
from tcprec.kernels.triton import conv_fwd as cf

ENV = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
NO_CUDA = not torch.cuda.is_available()
# conv_fwd._TILES as the code held it before it became data (commit e90722d), and the residual classes (decision 0130)
CODE_TILES = {"tap": (128, 128, 4, 3), "flat": (128, 128, 4, 3), "thin": (128, 128, 8, 4)}
RES_CLASSES = ("tap_res", "point_dual")


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args], env=ENV)


def test_loaded_table_equals_what_the_code_had():
    tiles = cf.load_tile_table()
    assert {c: tiles[c] for c in CODE_TILES} == CODE_TILES and set(tiles) == set(CODE_TILES) | set(RES_CLASSES)
    assert cf._TILES == tiles and set(cf._TILES) == set(cf.TILE_CLASSES)
    # the residual classes: fewer accumulators a program than the plain 128 x 128 (their epilogue keeps more live)
    assert all(tiles[c][0] * tiles[c][1] < 128 * 128 for c in RES_CLASSES)
    doc = json.loads(cf.TILE_TABLE_PATH.read_text())
    assert all(doc[c]["measured"] and doc[c]["source"] for c in cf.TILE_CLASSES)  # each value says why


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("thin"), r"classes \['thin'\] missing"),
    (lambda d: d["tap"].update(value=[128, 128, 6, 3]),
     r"tap.value must be .* num_warps in \(4, 8\).* got \[128, 128, 6, 3\]"),
    (lambda d: d["flat"].update(value=[128, 96, 4, 3]),
     r"flat.value .* a power of two in 16..256.* got \[128, 96, 4, 3\]"),
    (lambda d: d["flat"].update(value=[128, 128, 4]), r"got \[128, 128, 4\]"),
    (lambda d: d["thin"].update(value=[128.0, 128, 8, 4]), r"thin.value"),
])
def test_a_broken_table_is_named(tmp_path, edit, match):
    doc = json.loads(cf.TILE_TABLE_PATH.read_text())
    edit(doc)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        cf.load_tile_table(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        cf.load_tile_table(path)


def test_pick_config_reads_the_table_and_a_candidate_table():
    g = G(256, 56, 56, 256, 256, 3, 3, (1, 1), (1, 1), (1, 1))  # "tap", fills the SMs
    assert cf.shape_class(g) == "tap" and cf.shape_class(G(8, 9, 9, 3, 8, 3, 3, (1, 1), (1, 1), (1, 1))) == "thin"
    cfg = cf.pick_config(g, fp8=False)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]) == CODE_TILES["tap"]
    cfg = cf.pick_config(g, fp8=False, tiles={**CODE_TILES, "tap": (256, 128, 8, 3)})
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]) == (256, 128, 8, 3)


@pytest.mark.parametrize("name, base, epilogue", [("vgg.conv3", "vgg.conv3", "plain"),
                                                   ("resnet50.l1c3+dual", "resnet50.l1c3", "dual"),
                                                   ("resnet18.l2+residual", "resnet18.l2", "residual")])
def test_parse_layer(name, base, epilogue):
    assert tcf.parse_layer(name) == (base, epilogue)
    assert tcf.layer_classes([name])[cf.shape_class(tcf.geometry(name, 256), epilogue)] == [name]


@pytest.mark.parametrize("bad", ["vgg.conv3+relu", "vgg.conv99", "resnet50.l1c3+"])
def test_bad_layer_names_are_refused(bad):
    with pytest.raises(ValueError, match=r"'\+residual' or '\+dual'.*" + bad.replace("+", r"\+")):
        tcf.layer_classes([bad])


def test_tune_layers_cover_every_class():
    classes = tcf.layer_classes(tcf.TUNE_LAYERS)
    assert set(classes) == set(cf.TILE_CLASSES)
    assert tcf.candidates_of((128, 128, 4, 3))[0] == (128, 128, 4, 3)
    assert tcf.candidates_of((128, 128, 4, 3)).count((128, 128, 4, 3)) == 1


def test_choose_tiles_takes_the_least_total_time():
    cur = {"tap": (128, 128, 4, 3), "flat": (128, 128, 4, 3), "thin": (128, 128, 8, 4)}
    times = {
        "tap": {(128, 128, 4, 3): [1.0, 2.0], (128, 256, 8, 3): [0.9, 1.9], (64, 128, 4, 4): [0.1, math.nan]},
        "flat": {(128, 128, 4, 3): [1.0], (256, 128, 8, 3): [1.0]},  # a tie: the current value stays
        "thin": {(128, 128, 8, 4): [math.nan], (128, 128, 4, 3): [math.nan]},  # all failed: the current value stays
    }
    got = tcf.choose_tiles(times, cur)
    assert got["tap"]["value"] == [128, 256, 8, 3] and got["tap"]["total_ms"] == pytest.approx(2.8)
    assert got["tap"]["previous"] == [128, 128, 4, 3] and got["tap"]["previous_total_ms"] == 3.0
    assert got["flat"]["value"] == [128, 128, 4, 3] and got["thin"]["value"] == [128, 128, 8, 4]


def test_written_table_round_trips_and_a_bad_one_is_not_written(tmp_path):
    path = tmp_path / "conv_fwd_tiles.json"
    shutil.copy(cf.TILE_TABLE_PATH, path)
    old = json.loads(path.read_text())
    chosen = tcf.choose_tiles({"tap": {(128, 256, 8, 3): [1.0], (128, 128, 4, 3): [2.0]}}, {"tap": (128, 128, 4, 3)})
    doc = tcf.table_document(chosen, old, {"tap": "GPU X: 128x256 1.0 ms"}, "tcprec tune conv-fwd (commit abc)")
    assert old["tap"]["value"] == [128, 128, 4, 3]  # the input document is not changed
    tcf.write_table(doc, path)
    assert cf.load_tile_table(path) == {**cf._TILES, "tap": (128, 256, 8, 3)}
    assert json.loads(path.read_text())["tap"]["measured"] == "GPU X: 128x256 1.0 ms"
    doc["tap"]["value"] = [100, 256, 8, 3]
    with pytest.raises(ValueError, match=r"BLOCK_M in \(64, 128, 256\)"):
        tcf.write_table(doc, path)
    assert cf.load_tile_table(path)["tap"] == (128, 256, 8, 3) and not list(tmp_path.glob("*.tmp"))


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal shown without a GPU (tests/gpu runs the tuner)")
def test_tune_refuses_without_a_gpu(run, tmp_path):
    table = tmp_path / "t.json"
    shutil.copy(cf.TILE_TABLE_PATH, table)
    before = table.read_text()
    res = run("tune", "conv-fwd", "--layers", "yolo.conv2", "--table", table, "--out", tmp_path / "s.json")
    assert res.exit_code == 2, res.output
    assert "tcprec tune conv-fwd needs a CUDA GPU;" in res.output
    assert table.read_text() == before and not (tmp_path / "s.json").exists()


def test_tune_bad_options(run):
    res = run("tune", "conv-fwd", "--layers", "vgg.conv3,vgg.conv99")
    assert res.exit_code == 2 and "'vgg.conv99'" in res.output and "NETWORK_LAYERS" in res.output
    assert run("tune", "conv-fwd", "--batch", 0).exit_code == 2
    assert run("tune").exit_code in (0, 2) and "conv-fwd" in run("tune", "--help").output
