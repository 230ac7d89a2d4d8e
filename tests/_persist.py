"""The persistence round trip the quantized-model tests share (issue 40's contract)."""

import io

import torch


def assert_round_trips(q, other, x) -> torch.Tensor:
    """``other`` (the same structure, other weights or calibration) differs from ``q`` on ``x``; loading ``q``'s
    state_dict makes it give ``q``'s output bit for bit, and so does ``torch.save`` / ``torch.load`` of the whole
    ``q``.  Returns ``q(x)``."""
    with torch.no_grad():
        want = q(x)
        assert not torch.equal(other(x), want)
        other.load_state_dict(q.state_dict())
        assert torch.equal(other(x), want)
        buf = io.BytesIO()
        torch.save(q, buf)
        buf.seek(0)
        assert torch.equal(torch.load(buf, weights_only=False)(x), want)
    return want
