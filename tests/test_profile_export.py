"""tcprec.profile's SQLite (nsys-like layout) and HTML exports, on the CPU and on GPU-like events."""

import sqlite3

import pytest
import torch

import tcprec.profiling as P
from tcprec.profiling import Event, ProfileReport, analyze, annotate_nsys_sqlite, profile

NSYS_TABLES = {"StringIds", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
               "NVTX_EVENTS"}
OUR_TABLES = {"TCPREC_META", "TCPREC_LAYERS", "TCPREC_KERNEL_SUMMARY", "TCPREC_KERNEL_NAMES", "TCPREC_BREAKDOWN",
              "TCPREC_COPIES", "TCPREC_DTYPE_TRACE"}

# the documented query (docs/profiling.md): time in tensor-core kernels per layer, ms per inference
TC_PER_LAYER = """
SELECT layer, SUM(duration) / 1e6 / (SELECT COUNT(DISTINCT inference) FROM TCPREC_KERNELS) AS tc_ms
FROM TCPREC_KERNELS WHERE tensor_core = 1 GROUP BY layer ORDER BY tc_ms DESC"""


def _names(conn, kind):
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = ?", (kind,))}


@pytest.fixture(scope="module")
def cpu_report():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10))
    return profile(m, torch.randn(2, 3, 16, 16), warmup=1, iters=3)


def test_sqlite_from_a_cpu_profile(cpu_report, tmp_path):
    db = cpu_report.to_sqlite(tmp_path / "p.sqlite")
    conn = sqlite3.connect(db)
    assert NSYS_TABLES | OUR_TABLES <= _names(conn, "table") and "TCPREC_KERNELS" in _names(conn, "view")
    # nsys's own query shape: kernel names through StringIds, durations in ns
    rows = conn.execute("SELECT s.value, k.end - k.start, k.deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
                        "JOIN StringIds AS s ON s.id = k.shortName").fetchall()
    assert rows and all(d >= 0 and dev == -1 for _, d, dev in rows)  # cpu clock: the rows are CPU ops
    assert {"aten::conv2d", "aten::linear"} <= {n for n, _, _ in rows}
    view = conn.execute("SELECT name, layer, inference, start, \"end\", duration, tensor_core, instruction_class "
                        "FROM TCPREC_KERNELS").fetchall()
    assert len(view) == len(rows)
    assert {r[2] for r in view} == {0, 1, 2}  # three profiled inferences
    assert all(r[5] == r[4] - r[3] and r[6] == 0 and r[7] == "cpu op" for r in view)
    # every op attributed to a layer lies inside that layer's range of the same inference
    ranges = {(t[len(P.LAYER_SCOPE):], i): (s, e) for t, i, s, e in conn.execute(
        "SELECT text, tcprecInference, start, end FROM NVTX_EVENTS WHERE text LIKE 'tcprec.layer:%'")}
    inside = [(r[1], r[2], r[3], r[4]) for r in view if r[1] is not None]
    assert {r[0] for r in inside} == {"0", "1", "2", "3"}
    for layer, i, s, e in inside:
        lo, hi = ranges[(layer, i)]
        assert lo <= s <= e <= hi
    # the per-layer sum of op time never exceeds the layer's own time (its scope's wall time)
    layer_ms = dict(conn.execute("SELECT name, ms FROM TCPREC_LAYERS"))
    for layer, ns in conn.execute("SELECT layer, SUM(duration) FROM TCPREC_KERNELS WHERE layer IS NOT NULL "
                                  "GROUP BY layer"):
        assert ns / 1e6 / 3 <= layer_ms[layer] * (1 + 1e-9) + 1e-6
    trace = [v for _, v in conn.execute("SELECT step, value FROM TCPREC_DTYPE_TRACE ORDER BY step")]
    assert " -> ".join(trace) == cpu_report.dtype_trace
    assert dict(conn.execute("SELECT key, value FROM TCPREC_META"))["clock"] == "cpu"
    assert conn.execute(TC_PER_LAYER).fetchall() == []  # no tensor cores on a CPU


def _gpu_report():
    """A report built from GPU-like events (tests/test_profiling.py's two inferences): nvjet GEMM in 'conv'."""
    from test_profiling import _gpu_events

    res = analyze(_gpu_events(), {"quant": "Q", "conv": "QConv2d", "out": "O"}, ["quant", "conv", "out"])
    return ProfileReport(res.layers, res.breakdown, res.kernels, res.copies, "fp32 -> quant -> conv -> out -> fp32",
                         res.clock, res.wall_ms, "test GPU", 1, res.n_inferences, timeline=res.timeline)


def test_sqlite_from_gpu_events_answers_the_tensor_core_query(tmp_path):
    conn = sqlite3.connect(_gpu_report().to_sqlite(tmp_path / "g.db"))
    # nvjet ran 300 us per inference, launched inside 'conv' (it ran after the scope closed: launch time counts)
    assert conn.execute(TC_PER_LAYER).fetchall() == [("conv", pytest.approx(0.3))]
    kinds = dict(conn.execute("SELECT name, instruction_class FROM TCPREC_KERNELS"))
    assert kinds == {"_pack_bitplanes_kernel": "cuda-core", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT": "tensor-core mma"}
    copies = conn.execute("SELECT copyKind, COUNT(*), tcprecLayer FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                          "GROUP BY copyKind ORDER BY copyKind").fetchall()
    assert copies == [(1, 2, "quant"), (2, 2, "out"), (8, 2, "conv")]  # HtoD, DtoH, DtoD (CUPTI's codes)
    assert "nvjet_stray" not in {r[0] for r in conn.execute("SELECT value FROM StringIds")}  # outside the inferences


def test_annotate_an_nsys_export(tmp_path):
    db = tmp_path / "nsys.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, streamId INTEGER,
            correlationId INTEGER, demangledName INTEGER, shortName INTEGER, mangledName INTEGER);
        INSERT INTO StringIds VALUES (7, 'bmma_gemm'), (8, 'vectorized_elementwise_kernel');
        INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (100, 400, 0, 7, 1, 7, 7, NULL), (500, 550, 0, 7, 2, 8, 8, NULL),
                                                      (600, 1000, 0, 7, 3, 7, 7, NULL);""")
    conn.commit()
    annotate_nsys_sqlite(db)
    annotate_nsys_sqlite(db)  # twice: the view is replaced, not duplicated
    got = conn.execute("SELECT name, SUM(duration), tensor_core FROM TCPREC_KERNELS GROUP BY name ORDER BY name")
    assert got.fetchall() == [("bmma_gemm", 700, 1), ("vectorized_elementwise_kernel", 50, 0)]


def test_annotate_refuses_what_is_not_an_nsys_export(tmp_path):
    with pytest.raises(FileNotFoundError, match="nsys export --type sqlite"):
        annotate_nsys_sqlite(tmp_path / "missing.sqlite")
    db = tmp_path / "other.sqlite"
    sqlite3.connect(db).execute("CREATE TABLE t (x)")
    with pytest.raises(ValueError, match="CUPTI_ACTIVITY_KIND_KERNEL"):
        annotate_nsys_sqlite(db)


def test_html_is_self_contained(cpu_report, tmp_path):
    page = cpu_report.to_html(tmp_path / "p.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page and "http" not in page
    for lay in cpu_report.layers:
        assert f"<td>{lay.name}</td>" in page
    assert "aten::conv2d" in page and cpu_report.dtype_trace.replace(">", "&gt;") in page


@pytest.mark.parametrize("name, match", [("out", "is a directory"), ("nope/p.sqlite", "does not exist"),
                                         ("p.txt", "must end in")])
def test_export_paths_checked(cpu_report, tmp_path, name, match):
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=match):
        cpu_report.to_sqlite(tmp_path / name)
    with pytest.raises(TypeError, match="must be a str or os.PathLike"):
        cpu_report.to_html(3)


def test_report_without_timeline_refuses_sqlite(tmp_path):
    rep = ProfileReport([], {}, [], {}, "fp32", "cpu", 0.0, "cpu", 0, 1)
    with pytest.raises(RuntimeError, match="no timeline"):
        rep.to_sqlite(tmp_path / "p.sqlite")


def test_profiler_log_lines_silenced(capfd, monkeypatch):
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for _ in range(2):
        profile(m, torch.randn(1, 4), warmup=1, iters=1)
    assert "profiler_start" not in capfd.readouterr().err
    import os

    assert "KINETO_LOG_LEVEL" not in os.environ  # restored: set around our calls only


def test_user_kineto_level_is_kept(monkeypatch):
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")
    with P._kineto_quiet():
        import os

        assert os.environ["KINETO_LOG_LEVEL"] == "2"


def test_events_are_neutral():
    ev = [Event(P.ITER_SCOPE, "scope", 0, 10), Event("aten::mm", "op", 1, 5)]
    res = analyze(ev)
    assert [(a.name, a.kind, a.inference) for a in res.timeline] == [(P.ITER_SCOPE, "range", 0), ("aten::mm", "op", 0)]
