"""fp8mla's FP8MLA backend served by vLLM's OpenAI server on a GPU, against vLLM's FLASHMLA and TRITON_MLA.

Run on the GPU machine with the offline vLLM bundle (../shared/tools/vllm-gpu: vLLM 0.26.0, torch 2.11) and
fp8mla's wheel on PYTHONPATH:

    python3 lab/vllm_gpu/serve_compare.py --out DIR [--deadline-s 520]

A DeepSeek-V3-shaped model with random weights (std 0.05): 2 dense layers, hidden 2048, q_lora_rank 1536 and the
real V3 attention dimensions (kv_lora_rank 512, rope 64, qk_nope 128, v 128) at 128 heads, and a second one at
16 heads (one TP-8 rank's share); a word-level tokenizer of 512 tokens. Every server starts at once (each with
its own fixed KV pool, so none sizes its pool from memory another is taking), then, one server at a time:
  - completions, chat, streaming (the streamed text equals the unstreamed one), 8 concurrent requests;
  - greedy logprobs (top 5) of 8 prompts, one request at a time, compared with the reference server of the
    same model and cache dtype (FLASHMLA and TRITON_MLA) on every token both top-5 lists hold;
  - decode tokens/s at batch 1, 8, 64: B concurrent requests of a 1024-token prompt, max_tokens N and 1;
    (B x (N - 1)) / (time(N) - time(1)), best of 2.
CUDA graphs: ``mode 0`` (no torch.compile) with ``cudagraph_mode FULL_DECODE_ONLY`` for every backend alike;
eager: ``--enforce-eager``. Writes DIR/results.json, DIR/summary.txt, DIR/logs.txt (each server's log tail).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VOCAB, SPECIALS = 512, ["<unk>", "<s>", "</s>"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")
GRAPHS = ["--compilation-config", json.dumps({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                              "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]})]
EAGER = ["--enforce-eager"]
# name -> (model, backend, kv cache dtype, mode)
SERVERS = {
    "fp8mla_fp8_graphs": ("h128", "FP8MLA", "fp8", GRAPHS),
    "flashmla_fp8_graphs": ("h128", "FLASHMLA", "fp8", GRAPHS),
    "triton_fp8_graphs": ("h128", "TRITON_MLA", "fp8", GRAPHS),
    "fp8mla_bf16_graphs": ("h128", "FP8MLA", "auto", GRAPHS),
    "triton_bf16_graphs": ("h128", "TRITON_MLA", "auto", GRAPHS),
    "fp8mla_fp8_eager": ("h128", "FP8MLA", "fp8", EAGER),
    # vLLM's default page of 16 (FP8MLA prefers 64 on Hopper): the Gluon wide build instead of heads-on-M
    "fp8mla_fp8_graphs_p16": ("h128", "FP8MLA", "fp8", GRAPHS + ["--block-size", "16"]),
    "fp8mla_fp8_graphs_h16": ("h16", "FP8MLA", "fp8", GRAPHS),
    "flashmla_fp8_graphs_h16": ("h16", "FLASHMLA", "fp8", GRAPHS),
}
# ours -> the references it is compared with (same model, same cache dtype)
COMPARE = {
    "fp8mla_fp8_graphs": ["flashmla_fp8_graphs", "triton_fp8_graphs"],
    "fp8mla_bf16_graphs": ["triton_bf16_graphs"],
    "fp8mla_fp8_eager": ["flashmla_fp8_graphs", "triton_fp8_graphs", "fp8mla_fp8_graphs"],
    "fp8mla_fp8_graphs_h16": ["flashmla_fp8_graphs_h16"],
    "fp8mla_fp8_graphs_p16": ["fp8mla_fp8_graphs", "triton_fp8_graphs"],
    # the references with each other: how far two of vLLM's own backends are apart
    "flashmla_fp8_graphs": ["triton_fp8_graphs"],
}
THROUGHPUT = [n for n in SERVERS if "graphs" in n and not n.endswith("h16")]
PROMPTS = [[5, 17, 99, 3, 250, 7], list(range(10, 40)), [300, 301, 2 + 7, 9], list(range(100, 260)),
           [42] * 20, list(range(400, 500)), [11, 12], list(range(3, 503, 3))]
MAX_TOKENS = [12, 9, 16, 7, 14, 10, 8, 11]
BATCHES, DECODE_TOKENS, CONTEXT = (64, 1, 8), 96, 1024
GPU, HIDDEN = True, 2048


def words(ids):
    return " ".join(f"w{i - len(SPECIALS)}" for i in ids)


def write_model(path: Path, heads: int, hidden: int = 2048, seed: int = 1234) -> str:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    cfg_cls = getattr(transformers, "DeepseekV3Config", None) or transformers.DeepseekV2Config
    model_cls = getattr(transformers, "DeepseekV3ForCausalLM", None) or transformers.DeepseekV2ForCausalLM
    extra = {"n_group": 1, "topk_group": 1} if "V3" in cfg_cls.__name__ else {}
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1,
                  n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=2, q_lora_rank=1536,
                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  max_position_embeddings=4096, rope_theta=10000.0, initializer_range=0.05,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_scaling=None, **extra)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_cls(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": len(SPECIALS) + i for i in range(VOCAB - len(SPECIALS))})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return f"{cfg_cls.__name__}: {heads} heads"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name, model, backend, kv, mode, logdir):
        self.name, self.model, self.port = name, model, free_port()
        self.log_path = logdir / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "64",
               "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0", "--no-enable-prefix-caching",
               "--attention-backend", backend, "--kv-cache-dtype", kv, *mode]
        if GPU:
            cmd += ["--gpu-memory-utilization", "0.05"]
        # the bundle has no flashinfer: vLLM 0.26's sampler imports it unless told not to use it
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_USE_FLASHINFER_SAMPLER": "0"}
        self.log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.healthy_after = None

    def poll_healthy(self):
        if self.healthy_after is not None:
            return True
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status == 200:
                    self.healthy_after = time.monotonic() - self.t0
                    return True
        except OSError:
            pass
        return False

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=180, max_retries=0)

    def tail(self, n=25):
        self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        keep = [ln for ln in lines if "FP8MLA" in ln or "backend" in ln.lower() or "cudagraph" in ln.lower()
                or "Error" in ln][:40]
        return "\n".join(ln[:400] for ln in keep + ["..."] + lines[-n:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def complete(client, model, prompt, max_tokens, logprobs=5):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                  logprobs=logprobs, seed=0, extra_body={"ignore_eos": True})
    c = r.choices[0]
    return c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.text, c.finish_reason


def surfaces(server):
    """Completions, chat, streaming and 8 concurrent requests; returns what was checked."""
    cl, m = server.client(), server.model
    out = {}
    text = cl.completions.create(model=m, prompt=words(PROMPTS[1]), max_tokens=16, temperature=0.0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    chunks = cl.completions.create(model=m, prompt=words(PROMPTS[1]), max_tokens=16, temperature=0.0, stream=True,
                                   extra_body={"ignore_eos": True})
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    out["stream_equals_unstreamed"] = streamed == text and len(text.split()) == 16
    chat = cl.chat.completions.create(model=m, messages=[{"role": "user", "content": words(PROMPTS[0])}],
                                      max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    out["chat_tokens"] = len(chat.choices[0].message.content.split())
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda a: complete(cl, m, words(a[0]), a[1]), zip(PROMPTS, MAX_TOKENS)))
    out["concurrent_8_ok"] = all(len(r[0]) == n and r[4] == "length" and all(-40 < lp <= 0 for lp in r[1])
                                 for r, n in zip(runs, MAX_TOKENS))
    return out


def one_at_a_time(server):
    cl = server.client()
    return [complete(cl, server.model, words(p), n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def compare(ours, ref):
    """max, mean |dlogprob| over every token both top-5 lists hold, up to where the greedy runs part (and the
    reference's logprob gap at that step, which says whether it was a near-tie)."""
    diffs, partings = [], []
    for o, r in zip(ours, ref):
        for i, (t_ref, t_ours) in enumerate(zip(r[0], o[0])):
            top_o, top_r = o[2][i], r[2][i]
            diffs += [abs(top_o[t] - top_r[t]) for t in top_r if t in top_o]
            if t_ours != t_ref:
                partings.append(round(top_r[t_ref] - top_r.get(t_ours, -99.0), 4))
                break
    return {"max": round(max(diffs), 4), "mean": round(sum(diffs) / len(diffs), 5), "n": len(diffs),
            "partings_gap": partings}


def itl(server):
    """(sum, count) of the server's inter-token latency histogram (vLLM's own timing, no client overhead)."""
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return 0.0, 0.0
    got = {}
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        for suffix in ("_sum", "_count"):
            got[suffix] = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                              if ln.startswith(name + suffix))
        if got["_count"]:
            break
    return got["_sum"], got["_count"]


def decode_rate(server, batch, rng):
    """(tokens/s, seconds, tokens/s from the server's mean inter-token latency) of decode at ``batch`` concurrent
    requests: (batch x (N - 1)) / (time(N) - time(1)), best of 2 pairs of runs; and batch / mean ITL over the
    N-token runs (prefill chunks that share a step with decodes count in both)."""
    cl, m = server.client(), server.model

    def run(n):
        prompts = [words([rng.randrange(3, VOCAB) for _ in range(CONTEXT)]) for _ in range(batch)]
        t = time.perf_counter()
        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(lambda p: cl.completions.create(model=m, prompt=p, max_tokens=n, temperature=0.0,
                                                          extra_body={"ignore_eos": True}), prompts))
        return time.perf_counter() - t

    run(4)  # warm-up
    best, itl_sum, itl_count = None, 0.0, 0.0
    for _ in range(2):
        s0, c0 = itl(server)
        t_n = run(DECODE_TOKENS)
        s1, c1 = itl(server)
        itl_sum, itl_count = itl_sum + s1 - s0, itl_count + c1 - c0
        dt = t_n - run(1)
        best = dt if best is None else min(best, dt)
    by_itl = round(batch * itl_count / itl_sum, 1) if itl_sum > 0 else None
    return round(batch * (DECODE_TOKENS - 1) / best, 1), round(best, 3), by_itl


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=520)
    ap.add_argument("--only", default="", help="comma-separated server names (default: all)")
    ap.add_argument("--smoke", action="store_true",
                    help="a check of this script on a CPU: one vLLM CPU_MLA server, small sizes")
    args = ap.parse_args()
    global GPU, HIDDEN, BATCHES, DECODE_TOKENS, CONTEXT, SERVERS, COMPARE, THROUGHPUT
    if args.smoke:
        GPU, HIDDEN, BATCHES, DECODE_TOKENS, CONTEXT = False, 256, (1, 2), 6, 32
        SERVERS = {"smoke": ("h16", "CPU_MLA", "auto", EAGER)}
        COMPARE, THROUGHPUT = {"smoke": ["smoke"]}, ["smoke"]
    t_start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logdir = Path("/tmp/serve_logs")
    logdir.mkdir(parents=True, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "servers": {}, "compare": {},
           "throughput": {}, "errors": {}}
    import torch
    import vllm
    import fp8mla
    res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "fp8mla": fp8mla.__version__,
                       "gpu": torch.cuda.get_device_name(0) if GPU else "cpu", "cuda": torch.version.cuda,
                       "fp8mla_rev": os.environ.get("FP8MLA_REV", "")}
    try:
        import triton
        res["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    models = {}
    names = [n for n in SERVERS if not args.only or n in args.only.split(",")]
    for key, heads in (("h128", 128), ("h16", 16)):
        if key not in {SERVERS[n][0] for n in names}:
            continue
        path = Path(f"/tmp/model_{key}")
        res[f"model_{key}"] = write_model(path, heads, HIDDEN)
        models[key] = str(path)
    servers = {n: Server(n, models[SERVERS[n][0]], *SERVERS[n][1:], logdir) for n in names}
    try:
        pending = set(servers)
        while pending and time.monotonic() - t_start < args.deadline_s * 0.65:
            for n in list(pending):
                s = servers[n]
                if s.poll_healthy():
                    pending.discard(n)
                    res["servers"][n] = {"healthy_after_s": round(s.healthy_after, 1)}
                elif s.proc.poll() is not None:
                    pending.discard(n)
                    res["errors"][n] = f"exited {s.proc.returncode} before healthy"
            time.sleep(1)
        for n in pending:
            res["errors"][n] = "not healthy in time"
        print(f"[{time.monotonic() - t_start:.0f} s] healthy: {sorted(res['servers'])}", flush=True)
        runs = {}
        for n in res["servers"]:
            try:
                res["servers"][n].update(surfaces(servers[n]))
                runs[n] = one_at_a_time(servers[n])
            except Exception:  # noqa: BLE001 - report and go on with the others
                res["errors"][n] = traceback.format_exc()[-2000:]
        for ours, refs in COMPARE.items():
            for ref in refs:
                if ours in runs and ref in runs:
                    res["compare"][f"{ours} vs {ref}"] = compare(runs[ours], runs[ref])
        print(f"[{time.monotonic() - t_start:.0f} s] compared", flush=True)
        rng = random.Random(0)
        for batch in BATCHES:
            for n in THROUGHPUT:
                if n in runs and time.monotonic() - t_start < args.deadline_s:
                    try:
                        res["throughput"][f"{n} b{batch}"] = decode_rate(servers[n], batch, rng)
                    except Exception:  # noqa: BLE001
                        res["errors"][f"{n} b{batch}"] = traceback.format_exc()[-1500:]
        print(f"[{time.monotonic() - t_start:.0f} s] throughput done", flush=True)
    finally:
        with open(out / "logs.txt", "w") as f:
            for n, s in servers.items():
                f.write(f"===== {n} (port {s.port})\n{s.tail()}\n")
        for s in servers.values():
            s.stop()
        (out / "results.json").write_text(json.dumps(res, indent=1))
        lines = [f"{k}: {v}" for k, v in res["versions"].items()]
        lines += [f"server {n}: {v}" for n, v in res["servers"].items()]
        lines += [f"compare {k}: {v}" for k, v in res["compare"].items()]
        lines += [f"tokens/s {k}: {v}" for k, v in res["throughput"].items()]
        lines += [f"ERROR {k}: {v.splitlines()[-1] if v else v}" for k, v in res["errors"].items()]
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
