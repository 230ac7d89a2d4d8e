"""QAT on the GPU: after fp16-autocast training steps, the deployed model -- bit-serial and INT8 kernels, eager and
through tcprec.compile's CUDA graph -- gives logits bit-identical to the fake-quant model in eval mode."""

import pytest
import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec.train.models import resnet18, vgg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")


@pytest.mark.parametrize("build,prec", [(resnet18, "w1a2"), (resnet18, "w2a2"), (resnet18, "w1a1"), (vgg, "w1a2")])
def test_deployed_equals_fake_quant_on_gpu(build, prec):
    torch.manual_seed(0)
    net = build().cuda().to(memory_format=torch.channels_last)
    qat = tp.prepare_qat(net, prec)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 1, 28, 28, device="cuda", generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (64,), device="cuda", generator=g)
    opt = torch.optim.SGD(qat.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(qat(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    qat.eval()
    dep = tp.convert_qat(qat)
    assert any(r.backend == "bitserial" for r in dep.tcprec_summary.layers)
    with torch.no_grad():
        ref = qat(x)
        assert torch.equal(dep(x), ref)
        eng = tp.compile(dep, x)
        assert torch.equal(eng(x), ref)
