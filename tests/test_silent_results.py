"""Classes of silent wrong results (issue 40), each fixed at its root: a fused epilogue on a shared module,
metrics of complex / None input, layers left float without a warning, float64 models, the ``x.view(n, -1)``
idiom after a quantized conv, extremely scaled linear systems, and device mismatches."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import tcprec as tp  # noqa: E402
from tcprec import metrics  # noqa: E402


def _rel(y, ref):
    return float((y - ref).norm() / ref.norm())


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- (a) a module called from several places keeps its epilogue ops separate -------------------------------
class SharedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        a = torch.relu(self.bn(self.conv(x)))  # BN + ReLU after the first call only
        b = self.conv(-x)  # the second call: plain conv, negative outputs kept
        return self.fc(torch.flatten(a + b, 1)) + torch.relu(self.fc(torch.flatten(b, 1)))


def _bn_stats(m):
    torch.manual_seed(0)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 2.0)
            mod.weight.data.uniform_(0.5, 1.5)
    return m.eval()


def test_shared_module_is_not_fused_and_stays_correct():
    torch.manual_seed(0)
    m = _bn_stats(SharedConv())
    x = _x(4, 3, 8, 8)
    q = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None), calibration=x)
    recs = {r.name: r for r in q.tcprec_summary.layers}
    assert recs["conv"].fused == () and recs["fc"].fused == ()  # shared: nothing absorbed
    assert recs["conv"].precision == "w8a8"
    with torch.no_grad():
        ref = m(x)
    # int8 of a well-scaled net: ~1% error; the fused-on-both-calls bug gave ~14% (issue 40)
    assert _rel(q(x), ref) < 0.03


def test_single_call_module_is_still_fused():
    m = _bn_stats(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                                nn.Linear(8 * 8 * 8, 10)))
    q = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None), calibration=_x(4, 3, 8, 8))
    assert q.tcprec_summary.layers[0].fused == ("bn", "relu")


# -- (b) metrics refuse what they cannot compare ----------------------------------------------------------
@pytest.mark.parametrize("bad", [None, "1.0", torch.tensor([1 + 2j]), [1j, 2.0], object()])
@pytest.mark.parametrize("fn", [metrics.nrmse, metrics.sqnr_db, metrics.max_abs_error, metrics.max_rel_error])
def test_metrics_refuse_complex_none_and_non_numbers(fn, bad):
    with pytest.raises(TypeError, match="real|complex"):
        fn(bad, torch.tensor([1.0]))
    with pytest.raises(TypeError, match="real|complex"):
        fn(torch.tensor([1.0]), bad)


def test_metrics_still_take_numbers_lists_and_arrays():
    np = pytest.importorskip("numpy")
    assert metrics.max_abs_error([1.0, 2.5], np.array([1.0, 2.0])) == 0.5
    assert metrics.max_abs_error(3, 1.0) == 2.0


# -- (c) layers with no quantized path are named in the warning -------------------------------------------
def test_conv1d_only_model_is_quantized_not_silently_float():
    """Conv1d runs as a (1, k) Conv2d (nn/coverage.py): quantized, and listed as such."""
    m = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Conv1d(4, 4, 3)).eval()
    q = tp.quantize_model(m, "int8", calibration=_x(2, 3, 9), warn=False)
    assert [(r.name, r.precision) for r in q.tcprec_summary.layers] == [("0", "w8a8"), ("2", "w8a8")]
    x = _x(2, 3, 9)
    assert ((q(x) - m(x)).norm() / m(x).norm()).item() < 0.05


def test_conv3d_only_model_is_an_error_naming_the_layers():
    m = nn.Sequential(nn.Conv3d(3, 4, 3), nn.ReLU(), nn.Conv3d(4, 4, 1)).eval()
    with pytest.raises(ValueError, match=r"none of the model's 2 convolution\(s\).*0: Conv3d has no quantized path"):
        tp.quantize_model(m, "int8", calibration=_x(2, 3, 5, 5, 5))


# -- (d) float64 models are refused at conversion, with the fix --------------------------------------------
def test_float64_model_is_refused_with_the_fix():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double()
    with pytest.raises(ValueError, match=r"torch.float64.*model.float\(\)"):
        tp.quantize_model(m, "int8", calibration=_x(2, 3, 6, 6).double())
    assert m[0].weight.dtype == torch.float64  # nothing mutated


# -- (e) x.view(n, -1) after a quantized conv: LeNet / AlexNet ------------------------------------------------
class LeNet(nn.Module):
    def __init__(self, branch=False):
        super().__init__()
        self.branch = branch
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        if self.branch and bool(x.sum() > -1e30):  # data-dependent control flow: torch.fx cannot trace it
            x = x * 1.0
        x = x.view(x.size(0), -1)
        return self.fc2(torch.relu(self.fc1(x)))


@pytest.mark.parametrize("branch", [False, True], ids=["traced", "untraced"])
def test_view_after_a_quantized_conv_works(branch):
    torch.manual_seed(0)
    m = LeNet(branch).eval()
    x = _x(4, 1, 28, 28)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the untraced model's note
        q = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None), calibration=x)
    assert q.tcprec_summary.traced is not branch
    assert all(r.precision == "w8a8" for r in q.tcprec_summary.layers)
    with torch.no_grad():
        assert _rel(q(x), m(x)) < 0.03


# -- (f) linalg.solve of extremely scaled, well-conditioned systems ------------------------------------------
@pytest.mark.parametrize("sa,sb", [(1e308, 1.0), (1e-300, 1.0), (1e300, 1e300), (2.0 ** -1000, 2.0 ** -1000)])
def test_solve_extremely_scaled_systems(sa, sb):
    g = torch.Generator().manual_seed(0)
    n = 24
    A = torch.eye(n, dtype=torch.float64) + 0.05 * torch.randn(n, n, generator=g, dtype=torch.float64)
    b = torch.rand(n, generator=g, dtype=torch.float64) + 0.5  # |b| <= 1.5: b * 1e300 stays finite
    x_ref = torch.linalg.solve(A, b)  # cond(A) ~ 1.5: fp64 gives ~1e-15 relative
    x, info = tp.linalg.solve(A * sa, b * sb)
    assert info.backward_error <= 16
    # x = x_ref * sb / sa, exactly representable as computed: compare in a safe range
    got = x * (sa / sb) if math.isfinite(sa / sb) and sa / sb != 0 else x / x.abs().max() * x_ref.abs().max()
    assert float((got - x_ref).abs().max() / x_ref.abs().max()) < 1e-12


def test_solve_refuses_a_solution_that_overflows():
    A = torch.eye(4, dtype=torch.float64) * 1e-308
    with pytest.raises(ValueError, match="overflows float64"):
        tp.linalg.solve(A, torch.full((4,), 10.0, dtype=torch.float64))


# -- (g) device mismatches are clear ValueErrors --------------------------------------------------------------
def test_quantize_scale_on_another_device():
    x = _x(4, 8)
    with pytest.raises(ValueError, match=r"scale is on meta but x is on cpu.*scale.to\('cpu'\)"):
        tp.quantize(x, "int8", tp.PerChannel(0), scale=torch.ones(4, 1, device="meta"))
    # a one-element CPU scale (a number) is fine anywhere
    assert tp.quantize(x, "int8", scale=torch.tensor(0.1)).scale.device == x.device


def test_emulate_matmul_operands_on_two_devices():
    with pytest.raises(ValueError, match=r"a on cpu and b on meta"):
        tp.emulate.matmul(_x(4, 8), torch.ones(8, 3, device="meta"), acc_fmt="e5m10")
