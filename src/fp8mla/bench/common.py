"""Every timer and the ceiling probe, shared by every benchmark (one module: no benchmark imports another's).

Timers: :func:`events_ms` (CUDA events around each call), :func:`time_ms` (a CUDA-graph replay of ``fn``, L2
flushed: the kernels' time), :func:`step_time_ms` (CUDA events on a GPU, wall clock on a CPU: a whole model step
as it runs), :func:`cpu_time_ms` (wall clock: host work such as planning, or CPU dry runs) and
:func:`kernel_time_ms` (the sum of the device time of the kernels one call launches, from the profiler).

Ceilings are measured in the same run as the kernels: read bandwidth (``torch.sum`` over >= 4 GB) and bf16
matmul rate (8192^3).
"""
from __future__ import annotations

import datetime
import platform
import statistics
from dataclasses import dataclass

import torch


@dataclass
class Ceilings:
    read_gbps: float        # GB/s of torch.sum over >= 4 GB
    matmul_tflops: float    # bf16 8192^3

    def floor_ms(self, bytes_: float, flops: float) -> float:
        """max(bytes / read bandwidth, flops / matmul peak), in ms."""
        return max(bytes_ / (self.read_gbps * 1e9), flops / (self.matmul_tflops * 1e12)) * 1e3


def events_ms(fn, reps: int, flush=None) -> list[float]:
    """CUDA-event time of each of ``reps`` calls of ``fn()`` (``flush()`` before each, untimed)."""
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def measure_ceilings(device="cuda", read_gb: float = 4.0, reps: int = 20) -> Ceilings:
    """Read bandwidth (torch.sum over ``read_gb`` GB of bf16) and bf16 matmul TFLOP/s (8192^3, random data)."""
    n = int(read_gb * 1e9) // 2
    x = torch.randn(n // 4096, 4096, device=device).to(torch.bfloat16)  # random, never zeros
    torch.sum(x, dtype=torch.float32)
    t_read = statistics.median(events_ms(lambda: torch.sum(x, dtype=torch.float32), reps))
    nbytes = x.numel() * 2
    x = None   # (frees the memory: closures above read these names, so no del)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    t_mm = statistics.median(events_ms(lambda: a @ b, reps))
    return Ceilings(nbytes / (t_read * 1e-3) / 1e9, 2 * 8192**3 / (t_mm * 1e-3) / 1e12)


_events_ms = events_ms  # the old private name, still imported by some benchmarks


class L2Flush:
    """Overwrites a buffer larger than the L2 so each timed replay starts from DRAM."""

    def __init__(self, device="cuda"):
        size = torch.cuda.get_device_properties(device).L2_cache_size if torch.cuda.is_available() else 0
        self.buf = torch.empty(max(2 * size, 1 << 20), dtype=torch.int8, device=device)

    def __call__(self):
        self.buf.zero_()


def capture(fn):
    """A CUDA graph of ``fn()`` (warmed up on a side stream first), or None when ``fn`` cannot be captured
    (e.g. an op that syncs with the host)."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g
    except Exception:  # noqa: BLE001 - any capture failure means "time it with plain launches"
        torch.cuda.synchronize()
        return None


def time_ms(fn, *, reps: int = 50, warmup: int = 3, cuda_graph: bool = True, flush_l2: bool = True) -> float:
    """Median time of ``fn()`` in ms: captured in a CUDA graph when ``cuda_graph`` (falls back to plain launches
    if capture fails), L2 flushed before each replay."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    g = capture(fn) if cuda_graph else None
    run = g.replay if g is not None else fn
    run()
    torch.cuda.synchronize()
    flush = L2Flush() if flush_l2 else None
    return statistics.median(events_ms(run, reps, flush))


def cpu_time_ms(fn, reps: int, warmup: int = 1, **_) -> float:
    """Median wall-clock ms of ``fn()`` (no device sync: on a GPU this is the host's share of the work)."""
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def step_time_ms(fn, reps: int, device, warmup: int = 2) -> float:
    """Median ms of ``fn()`` as it runs (no graph is made here, no L2 flush): CUDA events on a GPU (the step's
    host work counts when the GPU waits for it), wall clock on a CPU."""
    if torch.device(device).type != "cuda":
        return cpu_time_ms(fn, reps, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(events_ms(fn, reps))


def kernel_time_ms(fn, reps: int = 3, exclude: tuple[str, ...] = ("nccl",)) -> tuple[float, int]:
    """``(device ms, kernels)`` per call of ``fn()``: the sum of the durations of the GPU kernels it launches
    (profiler, CUDA activity; memcpy/memset included), averaged over ``reps`` calls. This is what a step would
    take with no gap at all between its kernels.

    Kernels whose name contains one of ``exclude`` (case-insensitive) are left out: a collective's kernel (NCCL)
    runs as long as the slowest rank takes to arrive, so its duration is waiting, not work (a tp 2 step profiled
    with them in summed to 50 ms for a 1.5 ms step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us, n = 0.0, 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:  # a kernel, memcpy or memset as the GPU ran it
            if any(x in e.name.lower() for x in exclude):
                continue
            total_us += e.time_range.elapsed_us()
            n += 1
    return total_us / reps / 1e3, n // reps


def kernel_table(fn, reps: int = 3, top: int = 12) -> list[tuple[str, float, int]]:
    """The ``top`` GPU kernels of one call of ``fn()`` by device time: ``(name, ms per call, launches per call)``,
    collectives included (their time is partly the wait for other ranks). A diagnosis aid for step benchmarks
    (``fp8mla bench step --profile``); CUDA-graph replays are resolved into their kernels by the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            a = acc.setdefault(e.name[:80], [0.0, 0])
            a[0] += e.time_range.elapsed_us()
            a[1] += 1
    rows = sorted(((k, v[0] / reps / 1e3, v[1] // reps) for k, v in acc.items()), key=lambda r: -r[1])
    return rows[:top]


def start_run(what: str, out_dir: str) -> Ceilings | None:
    """The start every benchmark shares: refuse clearly without CUDA (None), make ``out_dir``, print the record of
    the run (date, GPU, driver, versions) and the ceilings measured now."""
    import os
    import sys
    if not torch.cuda.is_available():
        print(f"fp8mla bench {what}: needs a CUDA device (none found). The kernels are tested on the CPU by "
              "pytest under TRITON_INTERPRET=1; timings need a GPU.", file=sys.stderr)
        return None
    os.makedirs(out_dir, exist_ok=True)
    print(" ".join(f"{k}={v}" for k, v in environment().items()))
    ceil = measure_ceilings("cuda")
    print(f"ceilings: read {ceil.read_gbps:.0f} GB/s (torch.sum over 4 GB), bf16 matmul {ceil.matmul_tflops:.0f} "
          f"TFLOP/s (8192^3)")
    return ceil


def environment() -> dict:
    """Date, GPU, driver and versions for the record of a run."""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = "n/a"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
        try:
            import subprocess
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:  # noqa: BLE001
            env["driver"] = "n/a"
    return env
