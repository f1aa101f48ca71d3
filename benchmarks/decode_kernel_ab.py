"""Device time of the decode kernels on fixed inputs, for comparing two trees of graphsafe
(e.g. before and after a kernel change) on one GPU: `make` saves the inputs once, `time
LABEL` loads them and prints one JSON line per case (CUDA-event median of 5 medians of 30
calls, and their spread). PYTHONPATH picks the tree. Usage (GPU, repository root; the
other tree checked out in .baseline with `git worktree add .baseline <commit>`):

    PYTHONPATH=. python3 benchmarks/decode_kernel_ab.py make
    PYTHONPATH=.baseline python3 benchmarks/decode_kernel_ab.py time before
    PYTHONPATH=. python3 benchmarks/decode_kernel_ab.py time after
"""
import json, statistics, sys, torch
PATH = "/tmp/cost_inputs.pt"
dev = "cuda"

def make():
    g = torch.Generator().manual_seed(0)
    out = {}
    def mla(B, H, ctx, bs=64):
        mb = ctx // bs; nb = B * mb
        q = torch.randn(B, H, 576, generator=g).bfloat16()
        kv = torch.randn(nb, bs, 576, generator=g).bfloat16()
        table = torch.randperm(nb, generator=g).view(B, mb).int()
        lens = torch.full((B,), ctx, dtype=torch.int32)
        return (q, kv, table, lens, 576 ** -0.5, 512)
    out["mla_decode H128 B64 ctx8192"] = ("mla_decode", mla(64, 128, 8192))
    out["mla_decode H16 B128 ctx8192"] = ("mla_decode", mla(128, 16, 8192))
    out["mla_decode H128 B1 ctx8192"] = ("mla_decode", mla(1, 128, 8192))
    out["mla_decode H16 B128 ctx8192 page16"] = ("mla_decode", mla(128, 16, 8192, bs=16))
    nb = 2048
    kv = torch.randn(nb, 64, 576, generator=g).bfloat16()
    q = torch.randn(128, 128, 576, generator=g).bfloat16()
    idx = torch.randint(0, nb * 64, (128, 2048), generator=g).int()
    out["sparse_mla T128 H128 K2048"] = ("sparse_mla", (q, kv, idx, 576 ** -0.5, 512))
    B, hq, hk, d, bs, ctx = 64, 32, 8, 128, 16, 8192
    mb = ctx // bs; nb = B * mb
    kc = torch.randn(nb, bs, hk, d, generator=g).bfloat16(); vc = torch.randn(nb, bs, hk, d, generator=g).bfloat16()
    out["paged_attention_decode B64 32/8 d128 ctx8192"] = ("paged_attention_decode", (
        torch.randn(B, hq, d, generator=g).bfloat16(), kc, vc, torch.randperm(nb, generator=g).view(B, mb).int(),
        torch.full((B,), ctx, dtype=torch.int32), d ** -0.5))
    B, bs = 64, 64
    mb = ctx // bs; nb = B * mb
    kc = torch.randn(nb, bs, hk, d, generator=g).bfloat16(); vc = torch.randn(nb, bs, hk, d, generator=g).bfloat16()
    out["paged_attention_decode B64 32/8 d128 ctx8192 page64"] = ("paged_attention_decode", (
        torch.randn(B, hq, d, generator=g).bfloat16(), kc, vc, torch.randperm(nb, generator=g).view(B, mb).int(),
        torch.full((B,), ctx, dtype=torch.int32), d ** -0.5))
    from graphsafe.ops.indexer.cases import _make_paged
    for p in ({"B": 32, "next_n": 1, "H": 64, "D": 128, "block_size": 64, "max_model_len": 8192, "extra_cols": 0},
              {"B": 64, "next_n": 1, "H": 64, "D": 128, "block_size": 64, "max_model_len": 32768, "extra_cols": 0}):
        q8, cache, w, lens, table, length = _make_paged(p, torch.device("cpu"), g)
        lens = torch.full_like(lens, length)
        out[f"fp8_paged_mqa_logits B{p['B']} ctx{length}"] = ("fp8_paged_mqa_logits", (q8, cache, w, lens, table, length))
    torch.save(out, PATH)

def time_all(label):
    import graphsafe
    data = torch.load(PATH)
    for name, (op, args) in data.items():
        args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
        fn = getattr(graphsafe, op)
        for _ in range(10):
            fn(*args)
        torch.cuda.synchronize()
        meds = []
        for _ in range(5):
            ts = []
            for _ in range(30):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); fn(*args); b.record()
                ts.append((a, b))
            torch.cuda.synchronize()
            meds.append(statistics.median(x.elapsed_time(y) for x, y in ts))
        print(json.dumps({"tree": label, "case": name, "ms": round(statistics.median(meds), 5),
                          "spread": round(max(meds) - min(meds), 5)}), flush=True)
        del args
        torch.cuda.empty_cache()

if sys.argv[1] == "make":
    make()
else:
    time_all(sys.argv[2])
