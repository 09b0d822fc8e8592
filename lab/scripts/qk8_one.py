"""One variant of scripts/qk8_device.py's timing, alone in a fresh process (the chunks run of 2026-11-30 23:01 UTC
died with "unspecified launch failure" in its first H16 B64 L8k shape after several variants in one process):

    for v in default qk8 qk8_chunks qk8_chunks_m2 default_m2; do PYTHONPATH=$PWD/src python3 scripts/qk8_one.py $v 16 64 8192; done

Prints "OK <variant> ... ms" (CUDA-graph timing, L2 flushed, median of 30) or dies with the CUDA error."""
import importlib.util, os, sys
import torch
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
spec = importlib.util.spec_from_file_location("qk8_device", os.path.join(ROOT, "scripts/qk8_device.py"))
q = importlib.util.module_from_spec(spec); spec.loader.exec_module(q)
KW = dict(default=dict(qk8=0), qk8=dict(qk8=2), qk8_chunks=dict(qk8=2, chunks=True),
          qk8_chunks_m2=dict(qk8=2, chunks=True, mode=2), default_m2=dict(qk8=0, mode=2))
v = sys.argv[1]
H, B, L = (int(a) for a in sys.argv[2:5])
c = q.dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
p = q.QPlan(c, **KW[v])
p.run(); torch.cuda.synchronize()
ms = q.dv.graph_ms(p.run, q.dv.Flush(), reps=30)
torch.cuda.synchronize()
print(f"OK {v} H{H} B{B} L{L} {ms:.4f} ms", flush=True)
