"""One variant of scripts/fused_merge_device.py's timing, alone in this process (the fault seen there at H16 B64 L8k
on 2026-11-30 needed several variants in one process; each alone ran clean at 21:06 UTC):

    for t in separate kernel_only separate_v1 fused_kernel_only fused16 fused_all; do
        PYTHONPATH=$PWD/src python3 scripts/fused_merge_repro.py $t 16 64 8192; done

Prints "OK <variant> ... ms" (CUDA-graph timing, L2 flushed) or dies with the CUDA error."""
import importlib.util, os, sys, torch
ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "src"))
spec = importlib.util.spec_from_file_location("fmd", os.path.join(ROOT, "scripts/fused_merge_device.py"))
fmd = importlib.util.module_from_spec(spec); spec.loader.exec_module(fmd)
dv, dsm = fmd.dv, fmd.dsm
tag = sys.argv[1]
H, B, L = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
c = dv.make_case([L] * B, H, 64, seed=B + H, nan_pool=False, spare=8)
kw = dict(kernel_only=dict(merge=False), fused_kernel_only=dict(fused=True, fuse_max=1, merge=False), separate={},
          fused_all=dict(fused=True), fused16=dict(fused=True, fuse_max=dsm.SEQ_PARTS))
flush = dv.Flush()
if tag == "separate_v1":
    run, p = fmd.v1_runner(c)
else:
    p = fmd.FPlan(c, **kw[tag]); run = p.run
run(); torch.cuda.synchronize()
ms = dv.graph_ms(run, flush, reps=20)
torch.cuda.synchronize()
print(f"OK {tag} H{H} B{B} L{L} {ms:.4f} ms merge_p {getattr(p, 'merge_p', '-')} merge_c {getattr(p, 'merge_c', '-')}")
