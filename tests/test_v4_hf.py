"""V4SparseAttention against Hugging Face's own attention math for DeepSeek V4
(``transformers.models.deepseek_v4.modeling_deepseek_v4.eager_attention_forward``: one KV head, K = V, the sink
concatenated to the scaled logits): the same keys given as a window segment plus a compressed segment over two
pools. Checks the sink's units and the score scale, not only agreement with fp8mla's own reference."""
from __future__ import annotations

import types

import pytest
import torch

import fp8mla
from fp8mla.testing import assert_close
from fp8mla.v4 import write_v4_pool

from conftest import BACKEND_PARAMS

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_v4"])
def test_matches_hf_eager_attention(backend, kv_format):
    g = torch.Generator().manual_seed(3)
    H, Lw, Lc, n = 16, 24, 10, 2
    fmt = fp8mla.get_v4_format(kv_format)
    window, comp = fmt.new_pool(4, 16, DEVICE), fmt.new_pool(2, 8, DEVICE)
    w_slots, c_slots = torch.randperm(64, generator=g)[:Lw], torch.randperm(16, generator=g)[:Lc]
    write_v4_pool(fmt, window, w_slots.to(DEVICE), (torch.randn(Lw, 512, generator=g) * 2).to(DEVICE))
    write_v4_pool(fmt, comp, c_slots.to(DEVICE), (torch.randn(Lc, 512, generator=g) * 2).to(DEVICE))
    q = (torch.randn(n, H, 512, generator=g) * 2).bfloat16().to(DEVICE)
    sinks = (torch.randn(H, generator=g) * 3).to(DEVICE)
    attn = fp8mla.V4SparseAttention(backend=backend)
    attn.plan(H, 512 ** -0.5, torch.bfloat16, kv_format, window_topk=32, window_page_size=16, compressed_topk=16,
              compressed_page_size=8, device=DEVICE)
    w_idx = torch.full((n, 32), -1, dtype=torch.int32)
    w_idx[:, :Lw] = w_slots.int()
    c_idx = torch.full((n, 16), -1, dtype=torch.int32)
    c_idx[:, :Lc] = c_slots.int()
    out = attn.run(q, window, w_idx.to(DEVICE), compressed_pool=comp, compressed_indices=c_idx.to(DEVICE),
                   sinks=sinks)
    # Hugging Face: [B, H, S, D] queries, one KV head [B, 1, L, D] (the window's rows then the compressed rows)
    kv = torch.cat([fmt.read(window, w_slots.to(DEVICE), torch.float64),
                    fmt.read(comp, c_slots.to(DEVICE), torch.float64)])
    module = types.SimpleNamespace(num_key_value_groups=H, sinks=sinks.double(), training=False)
    ref, _ = hf.eager_attention_forward(module, q.double().transpose(0, 1)[None], kv[None, None], kv[None, None],
                                        None, scaling=512 ** -0.5)
    assert_close(out, ref[0], 5e-3, "out")  # HF returns [B, S, H, D]
