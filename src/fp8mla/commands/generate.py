"""``fp8mla generate``: an attention-only decode loop over the paged FP8 cache, with continuous batching.

A stack of DeepSeek-style MLA layers (random or checkpoint weights; pre-norm + residual, no MLP or vocabulary)
serves ``--prompts`` requests of random lengths: up to ``--max-batch`` run at once, a finished one frees its pages
and a waiting one joins in the same step (its prefill mixed with the others' decode). The next input of a
sequence is its last output, RMS-normalized. Prints tokens/s and the cache's memory.

On a GPU, decode-only steps replay CUDA graphs (:class:`fp8mla.models.runner.DecodeRunner`, one graph per batch
bucket); steps where a prompt joins run eagerly. ``--eager`` runs every step eagerly (to compare tokens/s).

Tensor parallel: ``torchrun --nproc-per-node N -m fp8mla generate --tp N ...`` splits the heads over N ranks
(NCCL on GPUs, gloo on CPUs); every rank holds its own cache with the same page tables; rank 0 prints.
"""
from __future__ import annotations

import sys
import time
from collections import deque

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(p):
    from ..formats import FORMATS
    from ..models.config import CONFIG_NAMES
    p.add_argument("--config", default="tiny", help=f"model config: {', '.join(sorted(CONFIG_NAMES))} or a "
                   "config.json path (default tiny; ignored with --checkpoint)")
    p.add_argument("--checkpoint", default=None, help="local Hugging Face checkpoint directory (config.json + "
                   "safetensors); default: random weights")
    p.add_argument("--prompts", type=int, default=16, help="requests to serve (default 16)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt; lengths are drawn in "
                   "[len/2, len] (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="longest generation; each request draws its "
                   "own in [T/2, T] so that requests leave at different steps (default 16)")
    p.add_argument("--max-batch", type=int, default=8, help="requests running at once (default 8)")
    p.add_argument("--layers", default="2", help="MLA layers to stack, or 'all' for the config's (default 2)")
    p.add_argument("--kv-format", default="fp8_e4m3", choices=sorted(FORMATS), help="cache format")
    p.add_argument("--page-size", type=int, default=16, help="tokens per cache page (default 16)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weights and activations")
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda when available)")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"), help="attention backend")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (launch with torchrun)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs: run every step eagerly (default on a GPU: "
                   "decode steps replay one CUDA graph per batch bucket)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress line")


def _positive(name: str, v: int) -> int:
    if v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v}")
    return v


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class _Progress:
    """One self-rewriting status line on a terminal; a line every ~10% of the requests otherwise."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.last_done = -1

    def update(self, step, running, waiting, done, generated, elapsed):
        if not self.enabled:
            return
        rate = generated / elapsed if elapsed > 0 else 0.0
        line = (f"step {step:5d}  running {running:3d}  waiting {waiting:4d}  done {done}/{self.total}  "
                f"{generated} tokens  {rate:,.1f} tok/s")
        if self.tty:
            bar = int(20 * done / max(self.total, 1))
            print(f"\r[{'#' * bar}{'.' * (20 - bar)}] {line}", end="", file=sys.stderr, flush=True)
        elif done != self.last_done and (done * 10 // max(self.total, 1) != self.last_done * 10 // max(self.total, 1)
                                         or done == self.total):
            print(line, file=sys.stderr, flush=True)
        self.last_done = done

    def close(self):
        if self.tty:
            print(file=sys.stderr)


def main(args) -> int:
    try:
        return _run(args)
    except (ValueError, RuntimeError, KeyError, OSError) as e:
        print(f"fp8mla generate: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a message, never a traceback, for whatever a user passes
        print(f"fp8mla generate: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _check_device(device) -> None:
    """``--device`` names a device torch has here (torch's own error is an assert about how it was built)."""
    if device is None:
        return
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device: expected cpu, cuda or cuda:N, got {device!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {device!r} asked for, but torch sees no CUDA device here (torch "
                         f"{torch.__version__}); use --device cpu")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise ValueError(f"--device: expected cuda:0 .. cuda:{torch.cuda.device_count() - 1}, got {device!r}")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: expected cpu or cuda, got {device!r}")


# Host bytes each request costs before it runs (its drawn lengths: two int64 tensors and two Python lists).
BYTES_PER_REQUEST = 100


def _check_sizes(args, cfg, layers: int, device: torch.device) -> None:
    """Refuse sizes whose cache (or request list) cannot fit in the device's memory, before allocating anything:
    a 10**12-token request would otherwise end in a raw allocator error that names no flag."""
    from ..cache_checks import device_memory
    from ..formats import get_format
    total = device_memory(device)
    if total is None:
        return
    if args.prompts * BYTES_PER_REQUEST > total:
        raise ValueError(f"--prompts: {args.prompts} requests take ~{args.prompts * BYTES_PER_REQUEST:.3g} B of host "
                         f"memory for their lengths alone, more than the {total / 2**30:.1f} GiB of {device}; "
                         f"expected fewer requests")
    ps = args.page_size
    per_seq = -(-(args.prompt_len + args.max_new_tokens) // ps)
    per_token = layers * get_format(args.kv_format).bytes_per_token(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    need = (args.max_batch * per_seq + 1) * ps * per_token
    # The largest prefill step's inputs too: up to --max-batch prompts of --prompt-len tokens at once.
    need += args.max_batch * args.prompt_len * cfg.hidden_size * 4
    if need > total:
        raise ValueError(
            f"--max-batch {args.max_batch} x (--prompt-len {args.prompt_len} + --max-new-tokens "
            f"{args.max_new_tokens}) tokens in pages of --page-size {ps}: the cache ({args.max_batch * per_seq} pages "
            f"x {ps} tokens x {per_token} B over {layers} layers) and the prompts' inputs need {need:.3g} B, more "
            f"than the {total / 2**30:.1f} GiB of memory of {device}; expected smaller sizes")


def _run(args) -> int:
    from ..models.config import load_config
    from ..models.deepseek import DeepseekMLAModel
    from ..models.parallel import init_tensor_parallel
    from ..models.runner import DecodeRunner

    _check_device(args.device)
    for name in ("prompts", "prompt_len", "max_new_tokens", "max_batch", "page_size", "tp"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    cfg = load_config(args.checkpoint if args.checkpoint else args.config)
    if args.layers == "all":
        layers = cfg.num_layers
    else:
        try:
            layers = _positive("--layers", int(args.layers))
        except ValueError as e:
            raise ValueError(f"--layers: expected a positive int or 'all', got {args.layers!r}") from e
    layers = min(layers, cfg.num_layers)
    _check_sizes(args, cfg, layers, torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    group, device = init_tensor_parallel(args.tp, args.device)
    rank = 0 if group is None else torch.distributed.get_rank(group)
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = DTYPES[args.dtype]
    t0 = time.perf_counter()
    kw = dict(dtype=dtype, device=device, tp_group=group, backend=args.backend)
    if args.checkpoint:
        model = DeepseekMLAModel.from_pretrained(args.checkpoint, layers, **kw)
    else:
        model = DeepseekMLAModel.random(cfg, layers, seed=args.seed, **kw)
    load_s = time.perf_counter() - t0

    # Requests: the same draws on every rank (one seeded generator), so every rank runs the same schedule.
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint((args.prompt_len + 1) // 2, args.prompt_len + 1, (args.prompts,), generator=g).tolist()
    new = torch.randint((args.max_new_tokens + 1) // 2, args.max_new_tokens + 1, (args.prompts,),
                        generator=g).tolist()
    ps = args.page_size
    per_seq = -(-(args.prompt_len + args.max_new_tokens) // ps)
    use_graphs = device.type == "cuda" and not args.eager and args.backend != "torch"
    # (+1 page: the runner's padding rows write into a page of their own)
    cache = model.make_cache(num_pages=args.max_batch * per_seq + use_graphs, page_size=ps, kv_format=args.kv_format)
    runner = (DecodeRunner(model, cache, max_batch=args.max_batch, max_context=args.prompt_len + args.max_new_tokens)
              if use_graphs else None)
    bf16_bytes = cache.num_pages * ps * len(model.layers) * 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)

    src = "random weights" if not args.checkpoint else f"checkpoint {args.checkpoint}"
    say(f"fp8mla generate: {cfg.name} ({src}, loaded in {load_s:.2f} s), {len(model.layers)} of {cfg.num_layers} "
        f"layers, {cfg.num_heads} heads ({model.num_local_heads} per rank, tp {args.tp}), {args.dtype}, {device}")
    say(f"cache: {cache.format.name}, {cache.bytes_per_token} B/token/layer, {cache.num_pages} pages x {ps} "
        f"tokens x {len(model.layers)} layers = {_mib(cache.memory_bytes())} per rank "
        f"(bf16 would take {_mib(bf16_bytes)})")
    say(f"requests: {args.prompts}, prompts of {min(lens)}-{max(lens)} tokens, {min(new)}-{max(new)} new tokens "
        f"each, up to {args.max_batch} at once")

    waiting = deque(range(args.prompts))
    running: dict[int, dict] = {}     # request -> {"sid", "left", "next"}
    done = generated = prompt_tokens = steps = peak_pages = 0
    decode_time, decode_tokens, decode_steps = 0.0, 0, 0
    backends = set()
    progress = _Progress(args.prompts, rank == 0 and not args.no_progress)
    hidden = cfg.hidden_size
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        while waiting or running:
            joined = []
            while waiting and len(running) < args.max_batch:
                r = waiting.popleft()
                x = torch.randn(lens[r], hidden, generator=g).to(device=device, dtype=dtype)
                running[r] = dict(sid=cache.add_sequence(), left=new[r], next=x)
                joined.append(r)
            order = list(running)
            counts = [running[r]["next"].shape[0] for r in order]
            x = torch.cat([running[r]["next"] for r in order])
            t_step = time.perf_counter()
            sids = [running[r]["sid"] for r in order]
            if runner is not None:
                out = runner.step(sids, counts, x)
                step = runner.last_step
            else:
                step = model.begin_step(cache, sids, counts)
                out = model(x, step)
            last = torch.tensor(counts, device=device).cumsum(0) - 1
            nxt = out[last].float()
            nxt = (nxt * torch.rsqrt(nxt.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            _sync(device)
            if not joined:
                decode_time += time.perf_counter() - t_step
                decode_tokens += len(order)
                decode_steps += 1
            backends |= {w.backend for w in (step.paged, step.ragged) if w is not None}
            steps += 1
            peak_pages = max(peak_pages, cache.num_pages - cache.num_free_pages)
            prompt_tokens += sum(lens[r] for r in joined)
            for i, r in enumerate(order):
                st = running[r]
                st["next"] = nxt[i: i + 1]
                st["left"] -= 1
                generated += 1
                if st["left"] == 0:
                    cache.free(st["sid"])
                    if runner is not None:
                        runner.release(st["sid"])
                    del running[r]
                    done += 1
            progress.update(steps, len(running), len(waiting), done, generated, time.perf_counter() - start)
    _sync(device)
    wall = time.perf_counter() - start
    progress.close()
    say(f"done: {done} requests, {prompt_tokens} prompt + {generated} generated tokens in {steps} steps, "
        f"{wall:.3f} s (attention backends: {', '.join(sorted(b for b in backends if b))}; "
        f"{'CUDA graphs' if runner is not None else 'eager'})")
    say(f"throughput: {generated / wall:,.1f} generated tok/s, {(prompt_tokens + generated) / wall:,.1f} tok/s "
        f"with prompts" + (f"; decode-only steps: {decode_tokens / decode_time:,.1f} tok/s, "
                           f"{1e3 * decode_time / decode_steps:.2f} ms/step" if decode_time > 0 else ""))
    peak_bytes = peak_pages * ps * len(model.layers) * cache.bytes_per_token
    say(f"cache use: peak {peak_pages}/{cache.num_pages} pages ({_mib(peak_bytes)} of {_mib(cache.memory_bytes())})")
    if runner is not None:
        st = runner.stats
        say(f"CUDA graphs: {st['graph_steps']} decode steps replayed ({st['captures']} graphs captured, batch buckets "
            f"{runner.buckets}), {st['eager_steps']} steps eager (a prompt joined); --eager turns graphs off")
        runner.close()
    else:
        say("steps: eager" + (" (--eager)" if args.eager else " (CUDA graphs need a GPU)"))
    if group is not None:
        torch.distributed.barrier(group)
        torch.distributed.destroy_process_group()
    return 0
