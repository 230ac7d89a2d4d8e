"""``tcprec.compile(model, example_input)``: a graph-captured inference engine with exactly two
host <-> device copies per call.

* Weights stay resident on the GPU (the model is moved there once); activations live in the
  CUDA-graph's private memory pool, in whatever form the layers exchange (packed bit planes between
  chained quantized convs).
* The whole forward is captured once in one CUDA graph: a call is one host-to-device copy of the
  input into the graph's static input buffer, one graph replay, one device-to-host copy of the static
  output into pinned host memory.  Nothing else crosses the bus (``copies_per_call`` = 2, checked by
  the GPU test that counts memcpy events in a profiler trace).
* Inputs are checked on the host before anything launches: a wrong shape or dtype is a clear
  ``ValueError`` that names the expected and the given shape, never a crash inside a kernel.

Without a GPU, ``compile`` still works (``Engine.mode == "eager"``): the same forward runs in
eager mode on the CPU (reference backends), so scripts behave the same everywhere; ``mode`` says so.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Engine", "compile"]


class Engine:
    """A compiled model; call it with a host (or device) tensor of the example's shape and dtype."""

    copies_per_call = 2  # input in, output out

    def __init__(self, model: nn.Module, example_input: torch.Tensor, *, device=None, warmup: int = 2):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(example_input, torch.Tensor) or not example_input.is_floating_point():
            raise TypeError("example_input must be a float tensor of the shape every call will use, got "
                            f"{type(example_input).__name__}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.input_shape = tuple(example_input.shape)
        self.input_dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()),
                                example_input.dtype)
        self.mode = "cuda-graph" if self.device.type == "cuda" else "eager"
        if self.mode == "eager":
            import warnings

            warnings.warn(f"tcprec.compile on {self.device}: no CUDA graph off the GPU, the engine runs the model "
                          "eagerly (Engine.mode == 'eager'); pass device='cuda' on a GPU machine to capture one",
                          UserWarning, stacklevel=3)
        self._graph = None
        if self.mode == "cuda-graph":
            self._capture(example_input, warmup)

    # -- capture -----------------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, example_input: torch.Tensor, warmup: int) -> None:
        self._static_in = example_input.to(self.device, self.input_dtype).clone()
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):  # JIT compiles, cuBLAS/cuDNN plans, allocations: outside the capture
            for _ in range(max(1, warmup)):
                self.model(self._static_in)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            out = self.model(self._static_in)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the model must return one tensor to be compiled, got {type(out).__name__}")
        self._static_out = out
        self.output_shape = tuple(out.shape)
        self._host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)

    # -- call --------------------------------------------------------------------------------------
    def _check(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"engine input must be a torch.Tensor of shape {self.input_shape}, got {type(x).__name__}")
        if tuple(x.shape) != self.input_shape:
            raise ValueError(
                f"engine input has shape {tuple(x.shape)} but the engine was compiled for {self.input_shape} "
                "(a CUDA graph has fixed shapes); compile another engine for this shape with "
                "tcprec.compile(model, example_input_of_that_shape)"
            )
        if not x.is_floating_point():
            raise ValueError(f"engine input must be a float tensor, got dtype {x.dtype}")

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Run one inference; returns a host tensor (a fresh copy) when ``x`` is on the host."""
        self._check(x)
        if self._graph is None:
            return self.model(x.to(self.device, self.input_dtype))
        self._static_in.copy_(x.to(self.input_dtype) if x.dtype != self.input_dtype else x)  # 1: HtoD
        self._graph.replay()
        if x.device.type != "cpu":
            return self._static_out.clone()
        self._host_out.copy_(self._static_out)  # 2: DtoH (pinned)
        torch.cuda.current_stream(self.device).synchronize()
        return self._host_out.clone()

    def replay(self) -> None:
        """Replay the graph on the data already in the static input buffer (timing the compute alone)."""
        if self._graph is None:
            raise RuntimeError("replay() needs a CUDA-graph engine (compiled on a GPU)")
        self._graph.replay()

    def __repr__(self) -> str:
        return f"Engine({type(self.model).__name__}, input {self.input_shape}, {self.mode}, device={self.device})"


def compile(model: nn.Module, example_input: torch.Tensor, *, device=None, warmup: int = 2) -> Engine:  # noqa: A001
    """Compile ``model`` for inference on inputs shaped like ``example_input`` (see the module docstring).

    >>> import torch
    >>> eng = compile(torch.nn.Linear(4, 2), torch.zeros(3, 4), device="cpu")
    >>> eng(torch.ones(3, 4)).shape, eng.mode
    (torch.Size([3, 2]), 'eager')
    """
    return Engine(model, example_input, device=device, warmup=warmup)
