"""``tcprec bench efficientnet``'s GPU path on the stand-in of tests/test_real_models.py (EfficientNet-Lite's layer
types at 32x32): every precision of ``SETTINGS`` converts an fp16 channels_last model with the real speed rule, runs
on the GPU kernels and beside torch fake quant, and is timed.  No assertion depends on which side is faster."""

import sys
from pathlib import Path

import pytest
import torch

from tcprec.bench import efficientnet as ef
from tcprec.nn.speed_rule import SpeedRule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")


def _standin():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_real_models import StandIn

    torch.manual_seed(0)
    return StandIn().eval()


@pytest.fixture(scope="module")
def ctx():
    return ef.prepare(16, 8, 64, 0, "cuda", loader=_standin, image=32, eval_batch=16, timed=True)


@pytest.mark.parametrize("precision", ef.PRECISIONS)
def test_every_setting_runs_on_the_gpu_with_the_speed_rule(ctx, precision):
    assert ctx.float_ms > 0 and ctx.base_row["precision"] == "fp16"
    row, det = ef.measure(ctx, precision, SpeedRule(batch=64))
    assert "fakequant_error" not in row, row
    assert row["quantized"] + row["floated_by_rule"] + row["float_other"] == 12  # 11 convs + the classifier
    assert row["quantized"] >= 1 and len(det["kept_fp16_by_rule"]) == row["floated_by_rule"]
    assert all(isinstance(v, str) and v for v in det["float_other"].values())  # every float layer says why
    assert 0 <= row["top1"] <= 100 and 0 <= row["fakequant_top1"] <= 100
    # timed alternately with the fp16 model (decision 0132): the speedup is against that paired fp16 time
    assert row["ms"] > 0 and row["fp16_ms"] > 0 and row["speedup"] == pytest.approx(row["fp16_ms"] / row["ms"])
    assert det["speed_rule"] and "conversion(s)" in det["speed_rule"][0]
