"""training/query_chunks.py: attention a chunk of queries at a time is sdpa's attention (its output and its
gradients), through a model as the loop builds it, and its backward holds what the plan says, with torch's CPU kernel
and with a stand-in for the CUDA kernel's allocations (tests/standins.py)."""

import pytest
import torch
import torch.nn.functional as F

from memrecipe.training.query_chunks import BandedAttention, QueryChunkedAttention, band


def attention_and_gradients(dtype, chunk, length=100, heads=4, kv_heads=2, dim=16, window=0):
    """(out, dq, dk, dv) in float64 from one causal attention over fixed inputs in `dtype`: chunked, or sdpa's own
    (chunk 0; `window`: each query its last `window` keys, under sdpa the dense mask transformers would give it);
    q, k and v in the layout transformers hands over ([b, h, L, d] views of [b, L, h, d])."""
    torch.manual_seed(0)
    inputs = [torch.randn(1, length, n, dim, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]
    q, k, v = [x.to(dtype).transpose(1, 2).requires_grad_() for x in inputs]
    if chunk and window:
        out = BandedAttention.apply(q, k, v, chunk, None, window)
    elif chunk:
        out = QueryChunkedAttention.apply(q, k, v, chunk, None)
    elif window:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=band(length, length, window), enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(torch.linspace(-1, 1, length, dtype=dtype).view(1, 1, length, 1).expand_as(out))
    return [out.double(), *(x.grad.double() for x in (q, k, v))]


@pytest.mark.parametrize("chunk", [7, 32, 50])  # chunks that do and do not divide the 100 tokens
def test_chunked_attention_is_sdpas_to_fp32_rounding(chunk):
    """Every chunk sees every key before its end and none after (the forward's bottom-right causal mask), and each
    block of queries and keys gets its own share of the gradients (the backward's chunk-wise logsumexp): the output
    and dq, dk, dv equal sdpa's in fp32. Reading the chunks' causal mask from the top left fails this."""
    reference = attention_and_gradients(torch.float64, 0)
    for got, want in zip(attention_and_gradients(torch.float32, chunk), reference):
        assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()


def test_in_bf16_the_chunks_gradients_are_as_close_to_exact_as_sdpas():
    """In bf16 (the recipe's precision) each block's gradients are rounded once and summed in fp32: the chunks'
    largest error against float64 is within 1.5x of sdpa's own in bf16, for 14 chunks of queries."""
    reference = attention_and_gradients(torch.float64, 0)
    sdpa = attention_and_gradients(torch.bfloat16, 0)
    chunked = attention_and_gradients(torch.bfloat16, 7)
    for name, ours, theirs, want in zip("out dq dk dv".split(), chunked, sdpa, reference):
        assert (ours - want).abs().max() <= 1.5 * (theirs - want).abs().max(), name


WINDOWS = [(7, 20), (32, 10), (32, 33), (50, 64), (100, 30), (7, 1)]  # (chunk, window): shorter, longer, one chunk


def test_the_window_mask_is_transformers_sliding_window():
    """band() is the mask transformers gives sdpa for a sliding window (masking_utils: sliding_window_overlay over
    the causal mask, through sdpa_mask), which the chunks compute without it."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    want = sdpa_mask(batch_size=1, q_length=40, kv_length=40, mask_function=sliding_window_causal_mask_function(9),
                     allow_is_causal_skip=False)
    assert torch.equal(band(40, 40, 9)[None, None], want)


@pytest.mark.parametrize("chunk, window", WINDOWS)
def test_a_sliding_window_in_chunks_is_sdpa_under_its_mask_to_fp32_rounding(chunk, window):
    """Each chunk against the keys its window reaches, one call forward and one backward with the band's mask
    (torch's CPU kernel): the output and dq, dk, dv equal sdpa's under transformers' dense sliding-window mask. A band
    one key short (each chunk from `window - 2` before it) fails this."""
    reference = attention_and_gradients(torch.float64, 0, window=window)
    for got, want in zip(attention_and_gradients(torch.float32, chunk, window=window), reference):
        assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()


def flash_rule(sq: int, sk: int, is_causal: bool, left, right) -> torch.Tensor:
    """Which keys flash-attn 2's kernel lets each query see, from the arguments torch's _flash_attention_forward and
    _backward hand to mha_fwd/mha_bwd (flash_api.cpp: a window past the keys is none, is_causal sets the right one to
    0, one side given makes the other the keys; then query i sees keys i + sk - sq - left .. i + sk - sq + right)."""
    left = -1 if left is None or left >= sk else left
    right = -1 if right is None or right >= sk else right
    right = 0 if is_causal else right
    if left < 0 and right < 0:
        return torch.ones(sq, sk, dtype=torch.bool)
    left, right = (sk if left < 0 else left), (sk if right < 0 else right)
    row, col = torch.arange(sq).unsqueeze(1) + sk - sq, torch.arange(sk)
    return (col >= row - left) & (col <= row + right)


def flash_values(q, k, v, seen, scale):
    """Attention in float64 over flash's layout (q [b, sq, h, d], k and v [b, sk, kv, d]): out and the logsumexp."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)).masked_fill(~seen, float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse


def fake_flash_forward(q, k, v, cum_q, cum_k, max_q, max_k, dropout, is_causal, debug, scale=None,
                       window_size_left=None, window_size_right=None):
    out, lse = flash_values(q, k, v, flash_rule(q.shape[1], k.shape[1], is_causal, window_size_left,
                                                window_size_right), scale)
    return out.transpose(1, 2).to(q.dtype), lse.float(), torch.empty(2), torch.empty(0), torch.empty(0)


def fake_flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, is_causal, rng, unused,
                        scale=None, window_size_left=None, window_size_right=None):
    inputs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    seen = flash_rule(q.shape[1], k.shape[1], is_causal, window_size_left, window_size_right)
    with torch.enable_grad():  # (a Function's backward runs without)
        again, _ = flash_values(*inputs, seen, scale)
        again.transpose(1, 2).backward(grad.double())
    return tuple(x.grad.to(q.dtype) for x in inputs)


@pytest.mark.parametrize("chunk, window", WINDOWS)
def test_on_cuda_the_window_reaches_flash_as_its_local_attention(monkeypatch, chunk, window):
    """The CUDA path (CudaFlash.banded: torch's _flash_attention_forward and _backward, each chunk's keys from
    window - 1 before it, window_size_left window - 1 under is_causal) through a kernel that follows flash-attn's own
    rule for those arguments (flash_rule, from flash_api.cpp): sdpa's results under the dense window mask. Off by one
    in window_size_left, or the band's first key one off, fails this."""
    from memrecipe.training import query_chunks

    monkeypatch.setattr(query_chunks, "kernel_for", lambda device: query_chunks.CudaFlash)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake_flash_forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fake_flash_backward)
    reference = attention_and_gradients(torch.float64, 0, window=window)
    for got, want in zip(attention_and_gradients(torch.float32, chunk, window=window), reference):
        assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()


def test_in_bf16_a_windows_chunks_are_as_close_to_exact_as_sdpa_under_its_mask():
    """In bf16 the band's gradients are rounded once a call and each key chunk's dK and dV summed in fp32: the
    chunks' largest error against float64 is within 1.5x of sdpa's own under the window's mask, 15 chunks of 7."""
    reference = attention_and_gradients(torch.float64, 0, window=20)
    sdpa = attention_and_gradients(torch.bfloat16, 0, window=20)
    chunked = attention_and_gradients(torch.bfloat16, 7, window=20)
    for name, ours, theirs, want in zip("out dq dk dv".split(), chunked, sdpa, reference):
        assert (ours - want).abs().max() <= 1.5 * (theirs - want).abs().max(), name


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def test_a_model_trains_through_the_chunks_as_through_sdpa(llama, monkeypatch):
    """apply() routes every attention module of a bf16 Llama through the chunks (two layers, 300 tokens, chunks of
    64: five a layer, counted); its loss is sdpa's and its weight gradients within bf16 rounding. A padded row (a
    mask) runs transformers' sdpa as it is."""
    import copy
    from types import SimpleNamespace

    from memrecipe.training import query_chunks

    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(llama)
    loss = plain(input_ids=ids, labels=ids).loss
    loss.backward()
    chunked = copy.deepcopy(llama)
    assert query_chunks.apply(chunked, SimpleNamespace(query_chunks=64), None) == 64
    calls = []
    kernel = query_chunks.CpuFlash
    monkeypatch.setattr(kernel, "forward", staticmethod(lambda *a, f=kernel.forward: (calls.append(1), f(*a))[1]))
    ours = chunked(input_ids=ids, labels=ids).loss
    ours.backward()
    assert len(calls) == 2 * 5 and ours.item() == pytest.approx(loss.item(), abs=1e-3)
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        assert torch.allclose(a.grad.float(), b.grad.float(), rtol=0.05, atol=0.02 * a.grad.abs().max().item()), name
    calls.clear()
    padded = torch.ones_like(ids)
    padded[:, -20:] = 0  # a padded row: sdpa's mask
    chunked(input_ids=ids, attention_mask=padded, labels=ids)
    assert not calls


@pytest.mark.parametrize("kind, extra", [("mistral", {}), ("qwen2", {"use_sliding_window": True,
                                                                  "max_window_layers": 1})])
def test_a_sliding_window_model_trains_through_the_chunks_without_a_dense_mask(monkeypatch, kind, extra):
    """A bf16 Mistral (every layer a window of 48 keys) and a Qwen2 (its second layer alone) over 300 tokens in
    chunks of 64: each windowed layer runs the band in 5 calls, with no [S x S] mask made (windowless_mask), a full
    one runs the causal chunks; the loss is transformers' sdpa under its dense window mask, and the weight gradients
    within bf16 rounding. With the mask function left as sdpa's, no band runs."""
    import copy
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from memrecipe.training import query_chunks

    config = AutoConfig.for_model(kind, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, sliding_window=48,
                                  attn_implementation="sdpa", **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(model)
    loss = plain(input_ids=ids, labels=ids).loss
    loss.backward()
    chunked = copy.deepcopy(model)
    query_chunks.apply(chunked, SimpleNamespace(query_chunks=64), None)
    calls = []
    for name in ("banded", "forward"):
        f = getattr(query_chunks.CpuFlash, name)
        monkeypatch.setattr(query_chunks.CpuFlash, name, staticmethod(lambda *a, f=f, n=name: (calls.append(n), f(*a))[1]))
    ours = chunked(input_ids=ids, labels=ids).loss
    ours.backward()
    windowed = 2 if kind == "mistral" else 1
    assert calls.count("banded") == windowed * 5 and calls.count("forward") == (2 - windowed) * 5
    assert ours.item() == pytest.approx(loss.item(), abs=1e-3)
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        assert torch.allclose(a.grad.float(), b.grad.float(), rtol=0.05, atol=0.02 * a.grad.abs().max().item()), name
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, query_chunks.NAME, sdpa_mask)
    calls.clear()
    assert chunked(input_ids=ids, labels=ids).loss.item() == pytest.approx(loss.item(), abs=1e-3)
    assert "banded" not in calls


def test_a_model_with_attention_dropout_is_refused(llama):
    import copy
    from types import SimpleNamespace

    from memrecipe.errors import RecipeError
    from memrecipe.training import query_chunks

    model = copy.deepcopy(llama)
    model.config.attention_dropout = 0.1
    with pytest.raises(RecipeError, match="attention_dropout is 0.1: set query_chunks=false"):
        query_chunks.apply(model, SimpleNamespace(query_chunks=64), None)


@pytest.mark.parametrize("kernel", ["cpu", "cuda"])
@pytest.mark.parametrize("length, chunk, sp, window", [(2048, 256, 1, 0), (4096, 256, 1, 0), (4096, 512, 1, 0),
                                                       (4096, 256, 2, 0), (4096, 256, 1, 1024), (4096, 512, 1, 300),
                                                       (4096, 256, 2, 700)])
def test_the_chunks_backward_holds_what_the_plan_says(monkeypatch, kernel, length, chunk, sp, window):
    """One attention's backward, 8 query heads over 2 K/V heads of 64 (GQA) in bf16, beside what the forward kept:
    torch's CPU kernel, and the CUDA kernel's allocations stood in for (standins.TorchFlash, from mha_bwd's source):
    the allocation peak is planning.activations.attention_backward_bytes(chunk=...) within 3% (the CPU's 5%, never
    under), dout (the gradient handed in) and the scratch of oneDNN's GEMMs on an AVX-512 CPU (measuring.kernels_own)
    aside. Without the fp32 sums of dK and dV, or with the kernel's buffers over the whole sequence (the
    plan of sdpa unchunked), the plan is off by more than 10%. `sp`: the call of one process of a Ulysses group of 2
    (a whole sequence for its 8 of the model's 16 heads), planned for that model at the process's slice (chunk / sp
    queries at every head; with the chunk's whole queries at every head, over by more than 10%). `window`: a
    sliding-window layer's band (BandedAttention), its key-side buffers over chunk + window - 1 keys and the key
    chunks the band reaches summed in fp32; planned over the chunk's own keys alone, under by more than 3% (but on
    CPU under Ulysses, where the join of dK's and dV's chunks binds at the end, not a call)."""
    import standins
    from measuring import allocation_peak_of, kernels_own
    from memrecipe.planning.activations import attention_backward_bytes
    from memrecipe.planning.architecture import Structure
    from memrecipe.planning.hardware import usable_cores

    if kernel == "cuda":
        standins.use_torch_flash(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(usable_cores())  # (the CPU kernel's blocks are per thread: the loop runs one a core)
    within = 0.03 if kernel == "cuda" else 0.05  # (the CPU's blocks of its second thread not always live at the peak)
    heads, kv, dim = 8, 2, 64
    q = torch.randn(1, length, heads, dim, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k, v = [torch.randn(1, length, kv, dim, dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in "kv"]
    out = BandedAttention.apply(q, k, v, chunk, None, window) if window else QueryChunkedAttention.apply(
        q, k, v, chunk, None)
    grad = torch.ones(1, length, heads, dim, dtype=torch.bfloat16).transpose(1, 2)
    try:
        peak = allocation_peak_of(kernels_own(lambda: out.backward(grad)))  # (oneDNN's GEMM scratch aside)
    finally:
        torch.set_num_threads(threads)
    s = Structure("llama", vocab=128, hidden=sp * heads * dim, layers=1, heads=sp * heads, kv_heads=sp * kv,
                  head_dim=dim, intermediate=4 * heads * dim, gated_mlp=True, linears=(), layer_norm_params=(),
                  top_params=(), tied_embeddings=False, window=window)
    dout, cuda, part = length * 2 * heads * dim, kernel == "cuda", length // sp  # (a slice's tokens at every head)
    plan = attention_backward_bytes(s, "lora", part, cuda, "sdpa", chunk, sp) - dout
    assert plan == pytest.approx(peak, rel=within) and plan >= peak * 0.999, (plan, peak)
    whole = attention_backward_bytes(s, "lora", part, cuda, "sdpa", sp=sp) - dout
    assert not whole == pytest.approx(peak, rel=0.1)
    unsummed = plan - length * 8 * kv * dim
    assert not unsummed == pytest.approx(peak, rel=0.1)
    if sp > 1 and (cuda or not window):  # (a CPU band's mask and blocks over the band: near a slice's whole at 700)
        assert not attention_backward_bytes(s, "lora", part, cuda, "sdpa", chunk) - dout == pytest.approx(peak, rel=0.1)
    if window and cuda:  # (a window of 1: a band of the chunk's own keys, no key chunk before it in fp32; on a CPU
        # the kernel's blocks over the band, which vary with its threads, are as large as the key chunk kept)
        from dataclasses import replace

        narrow = attention_backward_bytes(replace(s, window=1), "lora", part, cuda, "sdpa", chunk, sp) - dout
        assert narrow < 0.97 * peak, (narrow, peak)


def test_the_loop_builds_the_model_with_its_attention_in_chunks():
    """The rung's hook (planning/rungs.py: training.query_chunks.apply) runs where the loop builds the model: every
    attention module of the embedded model, LoRA on it, calls the chunks, `query_chunks=64` queries each; without the
    rung the model runs transformers' sdpa."""
    from helpers import loop_model
    from memrecipe.planning.registry import load_recipe
    from memrecipe.training import query_chunks
    from memrecipe.training.loading import embedded_model

    words = ["attn_implementation=sdpa", "packing=false", "per_device_train_batch_size=1"]
    model, _ = loop_model(load_recipe("single-gpu-lora", [*words, "query_chunks=64"]), embedded_model(), "bf16")
    chunks = [m.query_chunk for m in model.modules() if hasattr(m, "query_chunk")]
    assert model.config._attn_implementation == query_chunks.NAME and chunks and set(chunks) == {64}
    plain, _ = loop_model(load_recipe("single-gpu-lora", words), embedded_model(), "bf16")
    assert plain.config._attn_implementation == "sdpa"


def test_the_cuda_kernels_calls_take_the_arguments_torch_gives_on_meta_tensors(monkeypatch):
    """The CUDA path (query_chunks.CudaFlash: aten's _scaled_dot_product_flash_attention and its backward as the
    chunks call them, and _flash_attention_forward and _backward for a sliding window) run through torch's meta
    kernels, which check the shapes and the arguments as the CUDA ones
    take them (the dense forward's undefined cum_seq tensors passed back as None, K/V at their own heads): forward and
    backward of 3 chunks of 32 over 4 query and 2 K/V heads give the shapes sdpa's do."""
    from memrecipe.training import query_chunks

    monkeypatch.setattr(query_chunks, "kernel_for", lambda device: query_chunks.CudaFlash)
    q = torch.empty(1, 96, 4, 16, device="meta", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k, v = [torch.empty(1, 96, 2, 16, device="meta", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            for _ in "kv"]
    for attention in (lambda: QueryChunkedAttention.apply(q, k, v, 32, None),
                      lambda: BandedAttention.apply(q, k, v, 32, None, 40)):  # (and a sliding window: flash's local)
        q.grad = k.grad = v.grad = None
        out = attention()
        out.backward(torch.empty_like(out))
        assert out.shape == q.shape and (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_a_gpu_the_flash_kernel_cannot_run_on_is_refused_in_one_line(llama, monkeypatch):
    """torch's flash kernel needs compute capability 8.0 (flash_api.cpp): on an older GPU the rung is refused at
    load, naming it, rather than failing in the first step."""
    import copy
    from types import SimpleNamespace

    from memrecipe.errors import RecipeError
    from memrecipe.training import query_chunks

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    cuda = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(RecipeError, match=r"compute capability 8.0 .*\(this GPU: 7.5, head dim 16\)"):
        query_chunks.apply(copy.deepcopy(llama), SimpleNamespace(query_chunks=64), cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert query_chunks.apply(copy.deepcopy(llama), SimpleNamespace(query_chunks=64), cuda) == 64
