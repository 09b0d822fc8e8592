"""CPU decode speed of FP8MLA against vLLM's stock CPU backend (the figure in docs/engines.md, "CPU speed").

    .venv-vllm/bin/python tests/engines/bench_vllm_cpu.py [--profile]

The tiny DeepSeek-V2 of tiny_deepseek.py in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, eager), one
``LLM`` per configuration built first, then ``--repeats`` rounds in which the configurations take turns (so
that load from other work on a shared machine hits each alike): 8 requests x 256 greedy tokens (ignore_eos) per
``generate``, wall time and CPU time (``time.process_time``, all of the process's threads), best of the rounds.
The FP8MLA rows check that every step decoded through fp8mla, the stock row that none did. ``--profile`` prints where FP8MLA's run spends its time (cProfile, top 25 by cumulative).
Not collected by pytest (no ``test_`` prefix): a measurement, not a check.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).parent))

import tiny_deepseek  # noqa: E402

CONFIGS = [("CPU_MLA", "auto"), ("FP8MLA", "auto"), ("FP8MLA", "fp8")]


def build(checkpoint, backend, kv_cache_dtype, requests):
    from vllm import LLM, SamplingParams
    llm = LLM(model=checkpoint, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, attention_backend=backend,
              max_model_len=512, max_num_seqs=requests, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              seed=0)
    print(f"{backend}/{kv_cache_dtype}: block size {llm.llm_engine.vllm_config.cache_config.block_size}", flush=True)
    llm.generate(["w1 w2"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    return llm


def timed(name, llm, prompts, sp, tokens):
    """(wall, CPU) seconds of one ``generate``; the FP8MLA rows must decode through fp8mla (vLLM's CPU platform
    did not swap the backend), the stock row must not."""
    from fp8mla.integrations.vllm_backend import STATS
    calls = STATS.decode_calls
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    calls = STATS.decode_calls - calls
    assert (calls >= tokens - 1) if name.startswith("FP8MLA") else calls == 0, (name, calls)
    return wall, cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["CPU_MLA", "FP8MLA/auto", "FP8MLA/fp8"], action="append")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    from vllm import SamplingParams
    prompts = [tiny_deepseek.words([3 + (11 * i + 5 * j) % 500 for j in range(16)]) for i in range(a.requests)]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as d:
        ckpt = tiny_deepseek.write_checkpoint(d, max_positions=512)
        llms = {}
        for backend, kv in CONFIGS:
            name = backend if backend == "CPU_MLA" else f"{backend}/{kv}"
            if not a.only or name in a.only:
                llms[name] = build(ckpt, backend, kv, a.requests)
        res = {name: [] for name in llms}
        for i in range(a.repeats):  # the configurations take turns: load from other work hits each alike
            for name, llm in llms.items():
                res[name].append(timed(name, llm, prompts, sp, a.tokens))
            print(f"round {i} (wall/CPU): " + ", ".join(f"{n} {r[-1][0]:.2f}/{r[-1][1]:.2f} s" for n, r in res.items()),
                  flush=True)
        for name, t in res.items():
            print(f"{name:12s} {a.requests} x {a.tokens} tokens: best {min(w for w, _ in t):.2f} s wall, "
                  f"{min(c for _, c in t):.2f} s CPU", flush=True)
        if "CPU_MLA" in res:
            for name, t in res.items():
                wall = min(w for w, _ in t) / min(w for w, _ in res["CPU_MLA"])
                cpu = min(c for _, c in t) / min(c for _, c in res["CPU_MLA"])
                # the same round's ratio: each pair ran back to back, under the same load
                per_round = sorted(w / w0 for (w, _), (w0, _) in zip(t, res["CPU_MLA"]))
                median = per_round[len(per_round) // 2] if len(per_round) % 2 else \
                    (per_round[len(per_round) // 2 - 1] + per_round[len(per_round) // 2]) / 2
                print(f"{name:12s} {wall:.2f}x the stock CPU_MLA/bf16 wall time (best vs best), {cpu:.2f}x its CPU "
                      f"time; wall time per round {median:.2f}x (median of {len(per_round)})")
        for name, llm in llms.items():
            if a.profile and name.startswith("FP8MLA"):
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                llm.generate(prompts, sp, use_tqdm=False)
                pr.disable()
                print(f"--- {name}")
                pstats.Stats(pr).sort_stats("cumulative").print_stats(25)
                pstats.Stats(pr).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
