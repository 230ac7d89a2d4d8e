"""The command line, through typer's CliRunner (no subprocess; GPU-free paths)."""

import json

import pytest
import torch
from typer.testing import CliRunner

import tcprec
from tcprec.bench.common import rotating_buffers, write_json
from tcprec.cli import app
from tcprec.data import astronaut, bundled_astronaut
from tcprec.env import NO_GPU, device_report, tensor_core_paths

# Wide, so rich does not fold names and messages across lines.
ENV = {"COLUMNS": "200", "TERMINAL_WIDTH": "200"}
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(app, list(args), env=ENV)


def test_help(run):
    result = run("--help")
    assert result.exit_code == 0, result.output
    for command in ("info", "formats", "demo", "bench"):
        assert command in result.output
    assert run("bench", "--help").exit_code == 0
    assert "--numel" in run("bench", "cast", "--help").output


def test_info(run):
    result = run("info")
    assert result.exit_code == 0, result.output
    assert torch.__version__ in result.output
    assert "wgmma" in result.output
    if NO_CUDA:
        assert NO_GPU in result.output


def test_info_json(run):
    result = run("info", "--json", "-")
    assert result.exit_code == 0, result.output
    rep = json.loads(result.output)
    assert rep["torch"] == torch.__version__
    assert rep["cuda_available"] == torch.cuda.is_available()


def test_device_report_without_gpu_marks_every_path_unavailable():
    rep = device_report(probe_nvrtc=False)
    if NO_CUDA:
        assert rep["gpu"] is None
        assert all(not p["available"] and p["reason"] == NO_GPU for p in rep["tensor_core_paths"])


def test_tensor_core_paths_by_capability():
    def available(cc):
        return {p["path"] for p in tensor_core_paths(cc) if p["available"]}

    hopper, ampere = available((9, 0)), available((8, 0))
    assert "wgmma (Hopper warpgroup MMA)" in hopper and "fp8 mma e4m3/e5m2 (QGMMA)" in hopper
    assert "binary mma b1 AND+popc (BMMA)" in ampere and "int8 mma (IMMA)" in ampere
    assert not any("fp8" in p or "wgmma" in p for p in ampere)
    assert "wgmma (Hopper warpgroup MMA)" not in available((10, 0))  # Hopper only
    why = {p["path"]: p["reason"] for p in tensor_core_paths((8, 0))}
    assert "sm_89" in why["fp8 mma e4m3/e5m2 (QGMMA)"] and "sm_80" in why["fp8 mma e4m3/e5m2 (QGMMA)"]


def test_formats_table(run):
    result = run("formats")
    assert result.exit_code == 0, result.output
    assert "float8_e4m3fn" in result.output
    assert "448" in result.output  # e4m3 max, computed
    assert "57344" in result.output  # e5m2 max
    assert "mxfp4" in result.output and "int4" in result.output


def test_formats_named_custom(run):
    result = run("formats", "e5m7b12_sat", "int3")
    assert result.exit_code == 0, result.output
    assert "e5m7b12_sat" in result.output
    assert str(tcprec.format("e5m7b12_sat").max.__int__()) in result.output  # 522240
    assert "twos -4..3" in result.output


def test_formats_unknown_name_suggests(run):
    result = run("formats", "e4m3x")
    assert result.exit_code == 2
    assert "unknown format 'e4m3x'" in result.output and "did you mean" in result.output


def test_demo(run, tmp_path):
    path = tmp_path / "demo.json"
    result = run("demo", "--size", "4096", "--seed", "1", "--json", str(path))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "e4m3 (float8_e4m3fn)" in out and "fp4 (float4_e2m1fn)" in out
    if NO_CUDA:
        assert "reference" in out and "No CUDA GPU" in out
    if not hasattr(tcprec, "quantize"):
        assert "int8, int4 skipped" in out
    payload = json.loads(path.read_text())
    assert payload["command"].startswith("tcprec demo")
    assert payload["env"]["torch"] == torch.__version__
    for data in ("image", "normal"):
        nrmse = {r["format"]: r["nrmse"] for r in payload["rows"] if r["data"] == data and r["rounding"] == "nearest"}
        # more mantissa bits, less error: a property of the formats, not a stored number
        assert nrmse["bf16"] < nrmse["e4m3"] < nrmse["fp4"], nrmse
        assert nrmse["fp16"] < nrmse["bf16"]
        sr = {r["format"]: r["nrmse"] for r in payload["rows"] if r["data"] == data and r["rounding"] == "stochastic"}
        assert all(sr[f] > nrmse[f] for f in nrmse)  # unbiased, but noisier than nearest


def test_demo_integer_and_block_formats_through_quantize(run, tmp_path, monkeypatch):
    quantize = pytest.importorskip("tcprec.ops.quantize").quantize
    monkeypatch.setattr(tcprec, "quantize", quantize, raising=False)  # until tcprec exports it
    path = tmp_path / "demo.json"
    result = run("demo", "--size", "1000", "--formats", "int8,int4,mxfp4,fp4", "--json", str(path))
    assert result.exit_code == 0, result.output
    assert "skipped" not in result.output
    rows = json.loads(path.read_text())["rows"]
    for data in ("image", "normal"):
        nrmse = {r["format"]: r["nrmse"] for r in rows if r["data"] == data and r["rounding"] == "nearest"}
        assert nrmse["int8"] < nrmse["int4"]
        assert nrmse["mxfp4"] < 0.1


def test_demo_is_reproducible(run, tmp_path):
    rows = []
    for name in ("a.json", "b.json"):
        path = tmp_path / name
        assert run("demo", "--size", "1000", "--formats", "e5m2,fp4", "--json", str(path)).exit_code == 0
        rows.append(json.loads(path.read_text())["rows"])
    assert rows[0] == rows[1]


def test_demo_unknown_format_suggests(run):
    result = run("demo", "--size", "64", "--formats", "e4m3,fp5")
    assert result.exit_code == 2
    assert "--formats" in result.output and "unknown format 'fp5'" in result.output
    assert "did you mean" in result.output


def test_demo_bad_options(run):
    assert run("demo", "--device", "tpu").exit_code == 2
    assert run("demo", "--size", "0").exit_code == 2
    assert run("demo", "--formats", "e4m3,,fp4").exit_code == 2
    if NO_CUDA:
        result = run("demo", "--device", "cuda")
        assert result.exit_code == 2 and "no CUDA device" in result.output


@pytest.mark.skipif(not NO_CUDA, reason="checks the message shown without a GPU")
def test_bench_cast_without_gpu_exits_2(run):
    result = run("bench", "cast", "--numel", "1024")
    assert result.exit_code == 2
    assert "tcprec bench cast needs a CUDA GPU;" in result.output


def test_bench_json_is_standard_json(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"rows": [{"sqnr_db": float("inf"), "x": float("nan"), "ms": 0.5}]})
    assert json.loads(path.read_text()) == {"rows": [{"sqnr_db": "inf", "x": "nan", "ms": 0.5}]}


def test_rotating_buffers_exceed_l2():
    t = torch.zeros(1024)  # 4 KiB
    bufs = rotating_buffers(t, l2_bytes=64 * 1024)
    assert bufs[0] is t and sum(b.numel() * 4 for b in bufs) > 4 * 64 * 1024
    assert len(rotating_buffers(t, l2_bytes=100)) == 1


def test_bench_cast_bad_options(run):
    result = run("bench", "cast", "--formats", "e4m3,bf61")
    assert result.exit_code == 2 and "unknown format 'bf61'" in result.output
    result = run("bench", "cast", "--rounding", "nearest,stoch")
    assert result.exit_code == 2 and "unknown rounding 'stoch'" in result.output
    result = run("bench", "cast", "--formats", "mxfp8")
    assert result.exit_code == 2 and "block format" in result.output


def test_bundled_image_matches_scikit_image():
    crop = bundled_astronaut()
    assert crop.shape == (128, 128, 3) and crop.dtype == torch.float32
    photo, source = astronaut()
    if "scikit-image" in source and "bundled" not in source:
        assert torch.equal(crop, photo[40:168, 170:298])  # lossless PNG of the documented crop


def test_train_smoke_on_synthetic_data(run, tmp_path):
    res = run("train", "--data", "synthetic", "--model", "tiny_cnn", "--epochs", "1", "--limit-train", "128",
              "--limit-test", "64", "--batch-size", "32", "--nodes", "4", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "test accuracy" in res.output
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert len(metrics["history"]) == 1 and 0.0 <= metrics["final_test_acc"] <= 1.0
    assert (tmp_path / "curves.png").exists() and (tmp_path / "checkpoint.pt").exists()


def test_train_refuses_a_format_too_narrow_for_aps(run, tmp_path):
    res = run("train", "--data", "synthetic", "--grad-format", "e3m0", "--nodes", "64", "--out", str(tmp_path))
    assert res.exit_code == 2
    assert "too few exponent bits" in res.output


def test_bench_gemm_validates_configs_and_needs_a_gpu(run):
    bad = run("bench", "gemm", "--large-configs", "w9a1")
    assert bad.exit_code == 2 and "bits must be 1..8" in bad.output
    if NO_CUDA:
        res = run("bench", "gemm")
        assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


def test_bench_conv_bwd_validates_options(run):
    bad = run("bench", "conv-bwd", "--precision", "fp12")
    assert bad.exit_code == 2 and "not one of fp16, bf16, fp8" in bad.output
    bad = run("bench", "conv-bwd", "--passes", "0")
    assert bad.exit_code == 2 and "--passes must be >= 1, got 0" in bad.output
    if NO_CUDA:
        res = run("bench", "conv-bwd")
        assert res.exit_code == 2 and "needs a CUDA GPU" in res.output


# ------------------------------------------------------------------------------------------------
# One flag grammar and one precision vocabulary
# ------------------------------------------------------------------------------------------------


def test_version(run):
    result = run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"tcprec {tcprec.__version__}"


def test_json_dash_is_only_json_on_stdout(run, tmp_path):
    rep = json.loads(run("info", "--json", "-").stdout)
    assert rep["torch"] == torch.__version__
    res = run("solve", "--n", "48", "--factor", "e4m3", "--json", "-")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["n"] == 48
    path = tmp_path / "solve.json"
    assert run("solve", "--n", "48", "--json", str(path)).exit_code == 0
    assert json.loads(path.read_text())["n"] == 48


@pytest.mark.parametrize("alias, canonical", [("e4m3", "fp8"), ("float8_e4m3fn", "fp8"), ("bfloat16", "bf16"),
                                              ("half", "fp16"), ("float", "fp32")])
def test_solve_takes_every_factor_spelling_linalg_takes(alias, canonical):
    from tcprec.linalg.lu import canonical_factor
    from tcprec.precision import canonical_factor as shared

    assert canonical_factor is shared and shared(alias) == canonical


def test_solve_factor_error_lists_the_accepted_set(run):
    res = run("solve", "--n", "16", "--factor", "fp12")
    assert res.exit_code == 2
    for name in ("bf16", "fp16", "tf32", "fp8", "fp32", "e4m3", "bfloat16"):
        assert name in res.output


@pytest.mark.parametrize("text, want", [("int4", (4, 4, False)), ("w4a4", (4, 4, False)), ("int8", (8, 8, False)),
                                        ("W1A2", (1, 2, False)), ("e4m3", (8, 8, True)), ("fp8", (8, 8, True))])
def test_quantize_model_vocabulary(text, want):
    from tcprec.nn import parse_precision

    p = parse_precision(text)
    assert (p.w_bits, p.a_bits, p.fp8) == want
    assert parse_precision("float") is None


@pytest.mark.parametrize("text, match", [("fp16", "Write 'float'"), ("bf16", "Write 'float'"),
                                         ("fp32", "Write 'float'"), ("mxfp4", "no 'mxfp4' engine"),
                                         ("w9a1", "unknown layer precision")])
def test_quantize_model_refuses_with_what_to_write(text, match):
    import torch.nn as nn

    from tcprec.nn import quantize_model

    with pytest.raises(ValueError, match=match) as e:
        quantize_model(nn.Sequential(nn.Linear(8, 8)), text, calibration=torch.randn(2, 8))
    assert "'wXaY'" in str(e.value) and "'intN'" in str(e.value)  # the whole accepted set


def test_every_quantize_model_precision_is_a_cli_precision():
    from tcprec.precision import canonical_network_precision, parse_layer_precision

    for text in ["int1", "int4", "int8", "w1a2", "w3a5", "w8a8", "fp8", "e4m3", "float"]:
        parse_layer_precision(text)  # the API takes it ...
        assert canonical_network_precision(text)  # ... and so do run / profile / bench net
    assert canonical_network_precision("w8a8") == "int8" and canonical_network_precision("float") == "fp32"


def test_run_and_profile_reject_unknown_precision_with_the_set(run):
    for cmd in ("run", "profile"):
        res = run(cmd, "--precision", "fp12")
        assert res.exit_code == 2
        assert "wXaY" in res.output and "fp32" in res.output
