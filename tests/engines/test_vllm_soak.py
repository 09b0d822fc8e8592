"""fp8mla in vLLM under load and faults: the real OpenAI server with ``FP8MLA`` and an FP8 cache, a KV cache small
enough that requests are preempted, many requests of mixed lengths, and the faults a server meets every hour.

One server (``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, eager, multiprocessing on, block size
16 and a pool of ``KV_BLOCKS`` blocks, far less than the ``MAX_NUM_SEQS`` requests in flight need) is driven by
``CLIENTS`` threads of the ``openai`` client. Each thread runs a fixed, seeded list of requests (it stops by
itself: a count per thread and a deadline) of these kinds:

  complete    a completion (prompt 1-80 tokens, 4-40 new tokens), run to its length
  stream      a streamed completion read to its end
  disconnect  a streamed completion whose client closes the connection after a few chunks
  abort       a completion whose client gives up after ``ABORT_AFTER_S`` (the server must drop it)
  too_long    a prompt past --max-model-len: a clean 400 (BadRequestError), nothing else; or a prompt whose
              max_tokens reaches past it: completed, cut at the context limit (vLLM 0.32 shortens max_tokens)
  chat        a chat completion

Checks, after the load: the server is healthy; its log holds no ERROR line and no traceback; preemption
happened (``vllm:num_preemptions_total`` > 0, else the test did not test it); no request is left running or
waiting and the KV-cache usage (``vllm:kv_cache_usage_perc``) is back at its idle value (0: every block came
back); the resident memory of the server's processes (API server, engine core, worker), sampled every 2 s
after a warm-up round of the same load, stays within ``RSS_BAND_MB`` above its value then; a fixed set of
greedy requests, sent one at a time, gives the same tokens before and after the load. It prints requests/s, the
outcome counts, unexpected failures (must be 0) and the memory band.

A longer run (the figures in docs/engines.md):

    .venv-vllm/bin/python tests/engines/test_vllm_soak.py --rounds 20

Skipped unless vLLM and openai are importable (the engine venv that .ci/run builds; see docs/engines.md).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("openai") is None:
    pytest.skip("vLLM or openai is not installed (engine tests run in .ci/run's engine venv)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import tiny_deepseek  # noqa: E402
from test_vllm_server import NO_EOS, START_TIMEOUT_S, Server  # noqa: E402

from fp8mla.integrations import versions  # noqa: E402

if not versions.is_supported("vllm", versions.engine_version("vllm") or "0"):
    pytest.skip(f"vLLM {versions.engine_version('vllm')} is not a supported version", allow_module_level=True)

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 12
BLOCK_SIZE = 16
MAX_BURSTS = 10         # bursts of MAX_NUM_SEQS long requests at most, until one preempts
KV_BLOCKS = 24          # 384 token slots for up to 12 requests of up to 128 tokens: preemption
KV_VALUES_PER_BLOCK = BLOCK_SIZE * 576 * tiny_deepseek.NUM_LAYERS  # latent 512 + rope 64, 2 layers
CLIENTS = 8
REQUESTS_PER_CLIENT = 6   # per round
ROUNDS = 2                # measured rounds after the warm-up round: the CI run sends 3 x 48 requests
DEADLINE_S = 150          # a client stops starting requests after this (the CI run ends well before)
ABORT_AFTER_S = 0.5
# Resident memory of the server's processes over the CI run's measured rounds: at most this above its value after
# the warm-up round. vLLM's worker grows by some 40 MB a round at first, with the stock CPU_MLA backend as with
# FP8MLA, then levels off (docs/engines.md); 2 rounds measured +69 to +98 MB.
RSS_BAND_MB = 200
KINDS = ["complete"] * 4 + ["stream"] * 2 + ["disconnect", "abort", "too_long", "chat"]
GREEDY = [(tiny_deepseek.words([3 + (7 * i + 13 * j) % 500 for j in range(n)]), m)
          for i, (n, m) in enumerate(((3, 10), (20, 8), (57, 12), (90, 6)))]


def _prompt(rng, n) -> str:
    return tiny_deepseek.words([rng.randrange(3, tiny_deepseek.VOCAB) for _ in range(n)])


def _request(server, kind, rng):
    """Runs one request of ``kind``; returns its outcome name. Anything unexpected raises."""
    import openai
    client, model = server.client(), server.model
    n, m = rng.randint(1, 80), rng.randint(4, 40)  # at most 80 + 40 + a chat template's 2 < MAX_MODEL_LEN
    if kind == "complete":
        r = client.completions.create(model=model, prompt=_prompt(rng, n), max_tokens=m, temperature=0.8,
                                      seed=rng.randrange(1 << 30), extra_body=NO_EOS)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == m, r
        return "complete"
    if kind == "chat":
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": _prompt(rng, n)}],
                                           max_tokens=m, temperature=0.0, extra_body=NO_EOS)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == m, r
        return "chat"
    if kind in ("stream", "disconnect"):
        stream = client.completions.create(model=model, prompt=_prompt(rng, n), max_tokens=m, temperature=0.0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS)
        keep = rng.randint(1, 3)
        pieces, finish, usage = [], None, None
        for chunk in stream:
            pieces += [c.text for c in chunk.choices]
            finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
            usage = chunk.usage or usage
            if kind == "disconnect" and len(pieces) >= keep:
                stream.close()  # the client goes away mid-stream: the server must abort the request
                return "disconnect"
        assert finish == "length" and usage.completion_tokens == m and "".join(pieces).split(), (finish, usage)
        return "stream"
    if kind == "abort":
        impatient = client.with_options(timeout=ABORT_AFTER_S)
        try:
            impatient.completions.create(model=model, prompt=_prompt(rng, n), max_tokens=40, temperature=0.0,
                                         extra_body=NO_EOS)
        except openai.APITimeoutError:
            return "abort"
        return "abort_finished_first"  # the server was faster than the client's patience: also fine
    if kind == "too_long":
        if rng.random() < 0.5:  # the prompt alone is past the limit: refused with a 400
            try:
                client.completions.create(model=model, prompt=_prompt(rng, MAX_MODEL_LEN + rng.randint(1, 60)),
                                          max_tokens=1, temperature=0.0, extra_body=NO_EOS)
            except openai.BadRequestError as e:
                assert e.status_code == 400 and "maximum context length" in str(e), e
                return "too_long_400"
            raise AssertionError("a prompt past the context limit was not refused")
        # prompt + max_tokens past the limit: vLLM (0.32) shortens max_tokens to what the context has left
        r = client.completions.create(model=model, prompt=_prompt(rng, MAX_MODEL_LEN - rng.randint(2, 12)),
                                      max_tokens=64, temperature=0.0, extra_body=NO_EOS)
        assert r.choices[0].finish_reason == "length", r
        assert r.usage.prompt_tokens + r.usage.completion_tokens == MAX_MODEL_LEN, r.usage
        return "too_long_clamped"
    raise ValueError(f"kind: expected one of {sorted(set(KINDS))}, got {kind!r}")


def _client_loop(server, seed, count, deadline, outcomes, failures):
    rng = random.Random(seed)
    for _ in range(count):
        if time.monotonic() > deadline:
            return
        kind = rng.choice(KINDS)
        try:
            outcomes.append(_request(server, kind, rng))
        except Exception as e:  # noqa: BLE001 - counted and reported: the test asserts there are none
            failures.append(f"{kind}: {type(e).__name__}: {e}"[:1500])


def _session_rss_mb(leader_pid) -> float:
    """Resident memory of every process in the server's session (API server, engine core, workers), in MB."""
    return sum(_session_rss_by_process(leader_pid).values())


def _session_rss_by_process(leader_pid) -> Counter:
    """MB per process name (``comm``) in the server's session."""
    total = Counter()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            sid = int(stat.rsplit(")", 1)[1].split()[3])  # fields after the name: state ppid pgrp session
            if sid != leader_pid:
                continue
            rss = re.search(r"^VmRSS:\s+(\d+) kB", (d / "status").read_text(), re.M)
            total[stat.split("(", 1)[1].rsplit(")", 1)[0]] += int(rss.group(1)) / 1024 if rss else 0
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return total


def _greedy_tokens(server):
    out = []
    for prompt, m in GREEDY:  # one at a time: vLLM's CPU engine is not batch-invariant
        r = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=m,
                                               temperature=0.0, logprobs=1, extra_body=NO_EOS)
        out.append(r.choices[0].logprobs.tokens)
    return out


def _finished(server) -> Counter:
    """``vllm:request_success_total`` by ``finished_reason`` (stop, length, abort, error, ...)."""
    import urllib.request
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = Counter()
    for ln in text.splitlines():
        m = re.match(r'vllm:request_success_total\{.*finished_reason="(\w+)".*\} (\S+)$', ln)
        if m:
            out[m.group(1)] += int(float(m.group(2)))
    return out


def _wait_idle(server, timeout=60):
    """(running, waiting, kv usage) once nothing runs or waits and the usage is back to 0, or after timeout."""
    t0 = time.monotonic()
    while True:
        now = tuple(server.metric(n) for n in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                "vllm:kv_cache_usage_perc"))
        if now == (0, 0, 0) or time.monotonic() - t0 > timeout:
            return now
        time.sleep(1)


def start_server(checkpoint, log_path, backend="FP8MLA", kv_cache_dtype="fp8") -> Server:
    """The soak's server: ``KV_BLOCKS`` blocks of ``BLOCK_SIZE`` tokens whatever the cache dtype."""
    value_bytes = 1 if kv_cache_dtype.startswith("fp8") else 2
    return Server(checkpoint, log_path, "--attention-backend", backend, "--kv-cache-dtype", kv_cache_dtype,
                  "--block-size", str(BLOCK_SIZE),
                  "--kv-cache-memory-bytes", str(KV_BLOCKS * KV_VALUES_PER_BLOCK * value_bytes),
                  "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN))


def _load(server, clients, requests_per_client, deadline, seed, outcomes, failures):
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(_client_loop, server, seed + c, requests_per_client, deadline, outcomes, failures)
                  for c in range(clients)]:
            f.result()


def _burst(server, outcomes, failures):
    """``MAX_NUM_SEQS`` long requests started together (a barrier): 40-token prompts that each grow to 120 tokens,
    8 blocks a request against the pool's ``KV_BLOCKS``: the scheduler admits what the prompts fit and preempts as
    they grow, once four or more of them run together (the mixed rounds alone preempt only when requests overlap
    enough; ``_burst_until_preempted`` repeats it)."""
    gate = threading.Barrier(MAX_NUM_SEQS)

    def one(i):
        rng = random.Random(7000 + i)
        gate.wait(timeout=30)
        try:
            r = server.client().completions.create(model=server.model, prompt=_prompt(rng, 40), max_tokens=80,
                                                   temperature=0.0, extra_body=NO_EOS)
            assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 80, r
            outcomes.append("burst")
        except Exception as e:  # noqa: BLE001 - counted and reported: the test asserts there are none
            failures.append(f"burst: {type(e).__name__}: {e}"[:1500])
    with ThreadPoolExecutor(MAX_NUM_SEQS) as pool:
        list(pool.map(one, range(MAX_NUM_SEQS)))


def _burst_until_preempted(server, outcomes, failures, max_bursts=MAX_BURSTS) -> int:
    """Bursts (``_burst``) until the server reports a preemption, at most ``max_bursts``; how many ran. One burst
    preempts when at least four of its requests grow together, which a loaded 2-core CI machine has failed to give
    (three requests of 8 blocks fit the pool); and the engine's counters may reach /metrics only with later outputs,
    so each poll sends one short request first."""
    for n in range(1, max_bursts + 1):
        _burst(server, outcomes, failures)
        for _ in range(10):   # the engine's stats reach /metrics with later outputs: one short request flushes them
            try:
                server.client().completions.create(model=server.model, prompt="a", max_tokens=1, temperature=0.0)
            except Exception as e:  # noqa: BLE001 - counted and reported: the test asserts there are none
                failures.append(f"stats flush: {type(e).__name__}: {e}"[:1500])
            if server.metric("vllm:num_preemptions_total") > 0:
                return n
            time.sleep(0.5)
    return max_bursts


def soak(server, rounds=ROUNDS, requests_per_client=REQUESTS_PER_CLIENT, deadline_s=DEADLINE_S,
         clients=CLIENTS) -> dict:
    """The greedy set, a warm-up round of the load, then ``rounds`` measured rounds (each ``clients`` x
    ``requests_per_client`` requests, until the deadline), the greedy set again. Returns what the checks read."""
    idle_usage = server.metric("vllm:kv_cache_usage_perc")
    before = _greedy_tokens(server)
    outcomes, failures = [], []
    t0 = time.monotonic()
    deadline = t0 + deadline_s
    _load(server, clients, requests_per_client, deadline, 0, outcomes, failures)  # warm-up: every kind, batch
    bursts = _burst_until_preempted(server, outcomes, failures)                   # preemption, on any machine
    rss = [_session_rss_mb(server.proc.pid)]                                      # size and preemption once
    by_process = [_session_rss_by_process(server.proc.pid)]
    stop = threading.Event()

    def sample_rss():
        while not stop.wait(2):
            rss.append(_session_rss_mb(server.proc.pid))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    round_rss = [rss[0]]
    for i in range(rounds):
        _load(server, clients, requests_per_client, deadline, 1000 * (i + 1), outcomes, failures)
        round_rss.append(_session_rss_mb(server.proc.pid))
    elapsed = time.monotonic() - t0
    stop.set()
    sampler.join()
    idle_after = _wait_idle(server)
    rss.append(_session_rss_mb(server.proc.pid))
    after = _greedy_tokens(server)
    rss.append(_session_rss_mb(server.proc.pid))
    by_process.append(_session_rss_by_process(server.proc.pid))
    return dict(elapsed=elapsed, outcomes=Counter(outcomes), failures=failures, idle_usage=idle_usage,
                idle_after=idle_after, rss=rss, before=before, after=after,
                preemptions=server.metric("vllm:num_preemptions_total"), finished=_finished(server),
                round_rss=round_rss, by_process=by_process, bursts=bursts)


def report(r) -> str:
    n = sum(r["outcomes"].values()) + len(r["failures"])
    rss = r["rss"]
    return (f"soak: {n} requests in {r['elapsed']:.1f} s = {n / r['elapsed']:.2f} requests/s; "
            f"outcomes {dict(sorted(r['outcomes'].items()))}; unexpected failures {len(r['failures'])}; "
            f"engine's finished requests by reason {dict(sorted(r['finished'].items()))}; "
            f"preemptions {r['preemptions']:.0f} (bursts {r['bursts']}); running/waiting/KV usage after {r['idle_after']} "
            f"(idle {r['idle_usage']}); server RSS after the warm-up round {rss[0]:.0f} MB, then min "
            f"{min(rss):.0f}, max {max(rss):.0f}, end {rss[-1]:.0f} MB over {len(rss)} samples (band: max - "
            f"after warm-up {max(rss) - rss[0]:+.0f} MB); at the end of each round "
            f"{', '.join(f'{x:.0f}' for x in r['round_rss'])} MB; by process, after warm-up -> end: "
            + ", ".join(f"{k} {r['by_process'][0][k]:.0f} -> {v:.0f}" for k, v in sorted(r["by_process"][1].items())))


def check(server, r, rss_band_mb=RSS_BAND_MB):
    assert not r["failures"], "unexpected failures:\n" + "\n".join(r["failures"])
    assert server.healthy(), "the server is not healthy after the load"
    bad = [ln for ln in server.text().splitlines() if " ERROR " in ln or "Traceback" in ln]
    assert not bad, "the server logged errors:\n" + "\n".join(bad[:20])
    assert r["preemptions"] > 0, "no request was preempted: the KV cache was not small enough to test it"
    for kind in ("complete", "stream", "disconnect", "too_long_400", "too_long_clamped", "chat"):
        assert r["outcomes"][kind] > 0, f"no {kind!r} request ran: {r['outcomes']}"
    assert r["idle_after"] == (0, 0, r["idle_usage"]) and r["idle_usage"] == 0, \
        f"running, waiting, KV-cache usage after the load: {r['idle_after']} (idle usage {r['idle_usage']})"
    assert r["after"] == r["before"], "the greedy set gave other tokens after the load"
    assert max(r["rss"]) - r["rss"][0] <= rss_band_mb, f"server RSS left its band of {rss_band_mb} MB: {r['rss']}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_deepseek.write_checkpoint(tmp_path_factory.mktemp("tiny_deepseek_v2_soak"))


def test_fp8_server_under_load_disconnects_aborts_and_preemption(checkpoint, tmp_path, capsys):
    server = start_server(checkpoint, tmp_path / "soak.log")
    try:
        server.wait_healthy(START_TIMEOUT_S)
        r = soak(server)
        with capsys.disabled():  # the figures show in CI's log, pass or fail
            print(f"\n[soak] healthy after {server.healthy_after:.0f} s; {report(r)}; RSS band {RSS_BAND_MB} MB")
        check(server, r)
    finally:
        server.stop()


def main():
    ap = argparse.ArgumentParser(description="A longer soak of the FP8MLA server (the figures in docs/engines.md)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--requests-per-client", type=int, default=REQUESTS_PER_CLIENT)
    ap.add_argument("--clients", type=int, default=CLIENTS)
    ap.add_argument("--deadline", type=float, default=1500)
    ap.add_argument("--attention-backend", default="FP8MLA", help="CPU_MLA with --kv-cache-dtype auto: vLLM's own")
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--rss-band-mb", type=float, default=400)
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as d:
        server = start_server(tiny_deepseek.write_checkpoint(Path(d) / "ckpt"), Path(d) / "soak.log",
                              a.attention_backend, a.kv_cache_dtype)
        try:
            server.wait_healthy(START_TIMEOUT_S)
            print(f"healthy after {server.healthy_after:.0f} s", flush=True)
            r = soak(server, a.rounds, a.requests_per_client, a.deadline, a.clients)
            print(report(r), flush=True)
            check(server, r, a.rss_band_mb)
            print(f"soak: all checks passed (RSS band {a.rss_band_mb:.0f} MB)")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
