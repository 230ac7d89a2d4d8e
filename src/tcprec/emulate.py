"""``tcprec.emulate``: arithmetic with emulated custom-precision accumulators (the public namespace).

>>> import torch, tcprec as tp
>>> tp.emulate.matmul(torch.ones(1, 64), torch.ones(64, 1), acc_fmt="e4m3", mode="chunk", chunk=16)
tensor([[64.]])
"""

from .ops.emulate import MODES, explain_matmul, matmul

__all__ = ["matmul", "explain_matmul", "MODES"]
