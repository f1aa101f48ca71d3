"""Where a decode step's host time goes, B = 1, the demo model: eager and compiled (no graphs)
forward time with a sync, host issue time and CUDA-event time, a graph replay of the
compiled forward, and cProfile of each. Usage (GPU, repository root):

    PYTHONPATH=. python3 benchmarks/profile_decode_step.py [num_layers]
"""
import cProfile, io, pstats, sys, time, statistics, torch
from graphsafe.models import build_demo_model
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.manual_seed(0)
model, _ = build_demo_model(torch.device("cuda"), dtype=torch.bfloat16, seed=0, with_hf=False,
                            max_batch=1, max_model_len=300, index_topk=2048, num_hidden_layers=layers)
state = model.new_state()
tokens = model.prefill(state, [list(range(1, 257))]).argmax(-1)
def greedy(inputs):
    return model.decode_step(inputs).argmax(-1)
compiled = torch.compile(greedy, fullgraph=True, dynamic=True)
def timed(fn, n=30):
    ts, tin = [], []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        inputs = model.decode_inputs(state, tokens)
        t1 = time.perf_counter()
        fn(inputs)
        torch.cuda.synchronize(); t2 = time.perf_counter()
        tin.append(t1 - t0); ts.append(t2 - t1)
    return statistics.median(tin) * 1e3, statistics.median(ts) * 1e3
with torch.no_grad():
    for name, fn in (("eager", greedy), ("compiled", compiled)):
        for _ in range(5): fn(model.decode_inputs(state, tokens))
        tin, tf = timed(fn)
        inputs = model.decode_inputs(state, tokens)
        hs, ds = [], []
        for _ in range(30):
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter(); e0.record(); fn(inputs); e1.record(); t1 = time.perf_counter()
            torch.cuda.synchronize(); hs.append((t1 - t0) * 1e3); ds.append(e0.elapsed_time(e1))
        print(f"{name} layers={layers}: decode_inputs {tin:.3f} ms, forward+sync {tf:.3f} ms, "
              f"host issue {statistics.median(hs):.3f} ms, events {statistics.median(ds):.3f} ms")
        if name == "compiled":
            g = torch.cuda.CUDAGraph()
            s_ = torch.cuda.Stream(); s_.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s_):
                for _ in range(3): fn(inputs)
            torch.cuda.current_stream().wait_stream(s_); torch.cuda.synchronize()
            with torch.cuda.graph(g):
                fn(inputs)
            ds = []
            for _ in range(30):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); g.replay(); e1.record(); torch.cuda.synchronize(); ds.append(e0.elapsed_time(e1))
            print(f"graph replay of the compiled forward: {statistics.median(ds):.3f} ms")
        pr = cProfile.Profile(); inputs = model.decode_inputs(state, tokens)
        pr.enable()
        for _ in range(20): fn(inputs)
        pr.disable(); torch.cuda.synchronize()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
        print("\n".join(l[:160] for l in s.getvalue().splitlines() if l.strip() and "Ordered" not in l and "List reduced" not in l))
