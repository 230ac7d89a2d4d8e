"""tcprec profile --sqlite on the GPU: the kernel table holds device kernels (deviceId 0), tensor-core
kernels are found by name per layer, copies carry CUPTI's copy kinds.  Skipped without a CUDA GPU."""

import sqlite3

import pytest
import torch
from torch import nn

from tcprec.profiling import profile

TC_PER_LAYER = """
SELECT layer, SUM(duration) / 1e6 / (SELECT COUNT(DISTINCT inference) FROM TCPREC_KERNELS) AS tc_ms
FROM TCPREC_KERNELS WHERE tensor_core = 1 GROUP BY layer ORDER BY tc_ms DESC"""


def test_sqlite_of_an_fp16_conv_net(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.Conv2d(128, 128, 3, padding=1)).eval()
    net = net.cuda().half().to(memory_format=torch.channels_last)
    x = torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    rep = profile(net, x, iters=3)
    conn = sqlite3.connect(rep.to_sqlite(tmp_path / "g.sqlite"))
    assert {r[0] for r in conn.execute("SELECT DISTINCT deviceId FROM CUPTI_ACTIVITY_KIND_KERNEL")} == {0}
    tc = dict(conn.execute(TC_PER_LAYER).fetchall())
    assert {"0", "2"} <= set(tc) and all(ms > 0 for ms in tc.values())  # both convs on tensor cores
    # the SQL agrees with the report's own tensor-core time
    assert sum(tc.values()) == pytest.approx(rep.tensor_core_ms, rel=1e-6)
    durations = conn.execute('SELECT MIN("end" - start), COUNT(*) FROM TCPREC_KERNELS').fetchone()
    assert durations[0] >= 0 and durations[1] >= 3 * 2
