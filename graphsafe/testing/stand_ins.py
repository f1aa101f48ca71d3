"""Stand-ins for compiled kernels in CPU tests of launch wiring (which kernel a binding
runs, what it is called with, what happens when its compile fails)."""

from __future__ import annotations

import inspect

import torch


class StandInKernel:
    """Stands in for a `@triton.jit` / `@gluon.jit` kernel under `graphsafe.launch.bind`
    (it has the real kernel's signature; CPU tensors: every call is the plain
    `kernel[grid](...)` launch). Each launch records its tensor arguments in `calls`, a
    TMA descriptor as the tensor it views, its keyword arguments (the constexprs and
    options bound by keyword) in `keywords` and every argument by name in `arguments`,
    then raises `error` if one is given, as a failed compile would."""

    def __init__(self, signature: inspect.Signature, error: Exception | None = None):
        def fn(*args, **kwargs):
            pass

        fn.__signature__ = signature
        self.fn, self.error, self.calls, self.keywords, self.arguments = fn, error, [], [], []

    def __getitem__(self, grid):
        def launch(*args, num_warps, **kw):
            self.calls.append([getattr(a, "base", a) for a in args
                               if isinstance(a, torch.Tensor) or type(a).__name__ == "TensorDescriptor"])
            self.keywords.append(kw)
            signature = self.fn.__signature__
            named = {k: v for k, v in kw.items() if k in signature.parameters}  # (not the options)
            self.arguments.append(dict(signature.bind_partial(*args, **named).arguments))
            if self.error is not None:
                raise self.error

        return launch
