"""Script text for tests that compile GPU kernels for sm_90 on a machine without a GPU.

The tests run scripts in a fresh interpreter (without TRITON_INTERPRET) that record the
launches a backend binds, then compile each with Triton's whole pipeline and ptxas. This
prelude gives them the launcher's specialisation of a recorded launch (pointers and ints
divisible by 16, ints equal to 1 as constants, a TMA descriptor's type), a recorded bind's
arguments with a call's tensors in place (`bound_args`) and a count of a compiled kernel's
wgmma instructions. It expects `torch` and `ASTSource` to be imported by the script.
"""

SPECIALISE_PRELUDE = r"""
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}

def specialise(fn, args, kw, source=None):
    sig, consts, attrs, pos = {}, {}, {}, iter(args)
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", kw[p.name]
            continue
        v = next(pos)
        if type(v).__name__ == "TensorDescriptor":  # a host TMA descriptor: its block and layout
            from triton.runtime.jit import mangle_type
            sig[p.name] = mangle_type(v)
        elif isinstance(v, torch.Tensor):
            sig[p.name], attrs[(i,)] = "*" + TYPES[v.dtype], [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v == 1:
            sig[p.name], consts[p.name] = "constexpr", 1
        else:
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return (source or ASTSource)(fn=fn, signature=sig, constexprs=consts, attrs=attrs)

def bound_args(args, tensors):  # a recorded bind's arguments with a call's tensors in the placeholders' places
    it = iter(tensors)             # (a TMA descriptor, a template, stays: the signature is its block and layout)
    def take(a):
        if isinstance(a, torch.Tensor) or type(a).__name__ == "TensorDescriptor":
            t = next(it)
            return a if type(a).__name__ == "TensorDescriptor" else t
        return a
    return tuple(take(a) for a in args)

def wgmma_shapes(kernel):  # {"m64n32k16": count, ...}: the wgmma instructions of the PTX
    import re
    shapes = {}
    for m in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", kernel.asm["ptx"]):
        shapes[m] = shapes.get(m, 0) + 1
    return shapes
"""
