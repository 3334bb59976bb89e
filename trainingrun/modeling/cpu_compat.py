"""Let megatron-core run on a CPU-only torch build (CPU mode only; process-global; install before importing megatron).

megatron-core assumes CUDA in a handful of places that have nothing to do with the math:
  * tensors created with a literal ``device="cuda"`` / ``torch.cuda.current_device()`` (an int) — the forward's
    global memory buffer, the no-pipelining schedule's token counter, the optimizer's bookkeeping tensors;
  * ``Tensor.cuda()`` calls and asserts such as ``param.grad.type() == "torch.cuda.FloatTensor"``;
  * the tensor-parallel RNG tracker, which saves/restores the CUDA generator state
    (``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` / ``default_generators``).

`install()` makes each of those work on the CPU:
  1. a `torch.overrides.TorchFunctionMode` rewrites every ``device=`` argument that names CUDA (``"cuda"``,
     ``"cuda:N"``, ``torch.device("cuda")`` or a bare int, which torch reads as a CUDA index) to ``"cpu"``, and the
     same for ``Tensor.to("cuda")``;
  2. ``Tensor.cuda()`` returns the tensor itself; ``Tensor.type()`` with no argument reports the CUDA type name
     (``torch.cuda.FloatTensor``) so Megatron's type asserts pass — with an argument it converts as before;
  3. ``torch.cuda.current_device()`` returns 0, ``torch.cuda.device_count()`` 1, and the CUDA RNG functions act on
     the CPU generator (the tracker's "CUDA" state is the CPU state), so seeding is deterministic.

  4. the device routing stays active inside ``Tensor.backward`` / ``torch.autograd.backward`` (a mode is popped
     while it handles a call, which would otherwise leave the whole backward pass without it);
  5. ``torch.cuda.synchronize()`` returns at once (Megatron's distributed-checkpoint writer calls it before copying
     tensors out; there is no device to wait for).
  6. Megatron's fused element-wise kernels (``megatron.core.jit.jit_fuser``: bias-GeLU/SwiGLU, the MoE dispatcher's
     preprocessing, ...) run eagerly: Megatron wraps them in ``torch.compile`` as it is imported, which imports
     TorchDynamo and Inductor — about 3.6 s of CPU time in every trainer process here (median 9.7 → 6.1 s of CPU for
     importing megatron.core and its GPT model) — for kernels whose compiled form buys nothing on a CPU (and whose
     compilation fails on this machine's CPU build). `install()` therefore imports Megatron itself, with
     ``torch.compile`` an eager decorator for the length of that import, and switches Megatron's fuser off for the
     modules imported later; ``torch.compile`` is the real one again afterwards.
  7. Megatron's import leaves out Weights & Biases: megatron.core imports ``wandb`` (about 0.5 s) for its inference
     contexts' logging, which training never uses; the shim hides it for the length of that import only, so the
     run's own ``spec.metrics.wandb`` still imports the real one.

Nothing here runs on a GPU machine: `install()` refuses when CUDA is available. It touches no stream or event API
(tracing the trainer showed none are hit on the code paths we use). Never install it in the pytest
process; the trainer and the Megatron tests run in subprocesses.
"""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_MODE: TorchFunctionMode | None = None


def _is_cuda(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # torch reads a bare int device as a CUDA index
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU for every torch function called while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            # A mode is popped while its own __torch_function__ runs, so the whole backward pass would run without
            # it (torch 2.13 dispatches `torch.autograd.backward` to modes too); autograd functions that allocate on
            # `torch.cuda.current_device()` in backward (Megatron's all-gather/reduce-scatter mappings of the MoE
            # token dispatcher) need it there.
            return _backward_routed(*args, **kwargs)
        return func(*args, **kwargs)


def _backward_routed(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None, *,
                     gradient=None, grad_variables=None):
    """`torch.autograd.backward` with the device routing active while the autograd engine runs (the body of torch
    2.13's function after its dispatch check; `gradient` is `Tensor.backward`'s name for `grad_tensors`)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple  # deferred: private torch helpers
    from torch.autograd.graph import _engine_run_backward  # deferred: private torch helper

    grad_tensors = grad_tensors if grad_tensors is not None else (gradient if gradient is not None else grad_variables)
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    with _CudaToCpu():
        _engine_run_backward(tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph,
                             inputs, allow_unreachable=True, accumulate_grad=True)


def installed() -> bool:
    return _INSTALLED


def install() -> None:
    """Install the shim (idempotent). Call before `import megatron`; CPU mode only."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat.install() is for CPU-only runs; CUDA is available here")

    # (1) device routing, active for the rest of the process.
    _MODE = _CudaToCpu()
    _MODE.__enter__()

    # (2) Tensor.cuda() is a no-op; Tensor.type() reports the CUDA type name.
    original_type = torch.Tensor.type

    def _cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):  # noqa: ARG001
        return self

    def _type(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original_type(self)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.cuda = _cuda
    torch.Tensor.type = _type

    # (3) device queries and RNG on the CPU generator.
    cpu_gen = torch.default_generator
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    # Megatron's checkpoint writer waits for the device before copying tensors out (nothing to wait for here).
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    torch.cuda.manual_seed = lambda seed: cpu_gen.manual_seed(int(seed))
    torch.cuda.manual_seed_all = torch.cuda.manual_seed
    torch.cuda.default_generators = (cpu_gen,)
    torch.cuda._lazy_init = lambda: None
    # torch.cuda._lazy_call queues callbacks until CUDA initialises (never, here): run them at once instead, so
    # Megatron's RNG tracker really restores the states it saves.
    torch.cuda._lazy_call = lambda callable_, **kwargs: callable_()
    # The newer-torch branch of Megatron's `_set_cuda_rng_state` is taken when this private hook is absent.
    if hasattr(torch._C, "_cuda_setRNGState"):
        torch._C._cuda_setRNGState = lambda state: torch.set_rng_state(state)
    _eager_megatron_fusions()
    _INSTALLED = True


def _eager(model=None, **_options):
    """`torch.compile`'s signature, compiling nothing: the function itself (or, called with options only, a
    decorator that returns it)."""
    return model if model is not None else (lambda fn: fn)


def _eager_megatron_fusions() -> None:
    """(6) Import Megatron with `torch.compile` eager, then keep its fuser off for the modules imported later; (7)
    without wandb."""
    compile_ = torch.compile
    torch.compile = _eager
    hide_wandb = "wandb" not in sys.modules  # (7): None in sys.modules makes `import wandb` fail at once
    if hide_wandb:
        sys.modules["wandb"] = None
    try:
        from megatron.core import jit  # deferred: the import is what runs under the eager decorator

        jit.disable_jit_fuser()
    finally:
        torch.compile = compile_
        if hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
