"""The native kernels: the streaming linear product, its row and thread invariance, every code path
the library ships (AVX-512, AVX2, portable vectors) for both ops, and the refusals when it cannot be
built. (The fused layer against transformers' own: tests/test_fused_layers.py.)"""

from __future__ import annotations

import contextlib
import platform
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from harness.target import native, options

pytestmark = pytest.mark.skipif(
    native.native_kernels_problem() is not None,
    reason=f"no streaming kernel here: {native.native_kernels_problem()}",
)

# (M rows, K features, N outputs): vector-width multiples and tails on every axis, one-row steps,
# one pass over the weights (64 rows) and more (passes of 64 rows), a width smaller than one vector
SHAPES = [
    (1, 576, 1536),
    (2, 64, 100),
    (3, 37, 13),
    (4, 8, 5),
    (5, 1536, 576),
    (17, 48, 7),
    (64, 33, 9),
    (65, 40, 6),
    (150, 72, 20),
]


# how far a product may be from the float64 one: float32's summation order; bfloat16's one rounding
# of a float32 sum (half a unit in the last place, 2**-9 relative) plus the sum's own error
TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-4}, torch.bfloat16: {"rtol": 2**-8, "atol": 1e-3}}


def _exact(x, w, bias):
    """The product in float64, rounded once to the inputs' dtype."""
    return F.linear(x.double(), w.double(), None if bias is None else bias.double()).to(x.dtype)


def _check_product(op, dtype=torch.float32) -> None:
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n,)))
        for bias in (b, None):
            got = op(x, w, bias)
            assert got.shape == (m, n) and got.dtype == dtype
            torch.testing.assert_close(got, _exact(x, w, bias), **TOLERANCE[dtype])
            for r in {0, m // 2, m - 1}:  # each row alone gives the bits it gets beside the others
                assert torch.equal(op(x[r : r + 1], w, bias)[0], got[r]), (m, k, n, r)
    x = torch.randn(2, 3, 64, generator=g).to(dtype)  # leading dimensions, as a verify forward's [B, R, d]
    w = torch.randn(10, 64, generator=g).to(dtype)
    torch.testing.assert_close(op(x, w, None), _exact(x, w, None), **TOLERANCE[dtype])
    assert op(x, w, None).shape == (2, 3, 10)


def _layer_case(seed: int, masked: bool, dtype=torch.float32):
    """Random inputs of ``llama_layer``: a batch of 2 with 3 rows, head and model widths that are
    not multiples of a vector, some biases."""
    g = torch.Generator().manual_seed(seed)
    d, hq, hkv, dh, inter, cap, start = 40, 4, 2, 10, 24, 12, 5

    def rand(*shape, scale=0.3):
        return scale * torch.randn(*shape, generator=g)

    weights = [1 + rand(d), rand(hq * dh, d), rand(hkv * dh, d), rand(hkv * dh, d), rand(d, hq * dh), 1 + rand(d)]
    weights += [rand(inter, d), rand(inter, d), rand(d, inter)]
    biases = [rand(hq * dh), None, rand(hkv * dh), None, rand(inter), None, rand(d)]
    angles = rand(2, 3, dh // 2, scale=3.0).repeat(1, 1, 2)
    mask = None
    if masked:
        mask = torch.rand(2, 3, start + 3, generator=g) < 0.7
        mask[:, torch.arange(3), start + torch.arange(3)] = True  # every row sees itself
    buffers = [rand(2, hkv, cap, dh) for _ in range(2)]
    case = [rand(2, 3, d, scale=1.0), angles.cos(), angles.sin(), mask, *buffers, start, weights, biases]

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return [[cast(t) for t in c] if isinstance(c, list) else cast(c) for c in case]


def _check_layer(op, reference, dtype=torch.float32) -> None:
    """``op`` computes what ``reference`` computes (another build: float32 rounding; bfloat16's
    products may differ by a rounding in their last place, which the layer carries on)."""
    tol = {} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-6}
    for seed, masked in ((0, True), (1, False)):
        mine, ref = _layer_case(seed, masked, dtype), _layer_case(seed, masked, dtype)
        out = op(*mine[:6], *mine[6:], 1e-5, 1e-6, 0.3)
        assert out.dtype == dtype
        torch.testing.assert_close(out, reference(*ref[:6], *ref[6:], 1e-5, 1e-6, 0.3), **tol)
        torch.testing.assert_close(mine[4], ref[4], **tol)  # the cache rows each wrote
        torch.testing.assert_close(mine[5], ref[5], **tol)
        assert not torch.equal(mine[4], _layer_case(seed, masked, dtype)[4])  # the rows were written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_computes_the_linear_product_and_each_row_independently_of_the_others(dtype):
    native.load_native_kernels()
    _check_product(torch.ops.harness.streaming_linear, dtype)


# (M, K, N) for weights in panels (N a multiple of 16): every tile of both vector widths (in 256-bit
# vectors one to three rows in groups of panels, four or more in tiles of up to six; in 512-bit ones
# one row in groups of two panels, more in tiles of up to eight rows by three panels), a group cut
# short at a product's end, passes of 64 rows
PANEL_SHAPES = [
    (1, 576, 1536),
    (9, 40, 80),
    (12, 33, 112),
    (1, 40, 48),
    (2, 64, 96),
    (3, 37, 16),
    (4, 8, 32),
    (5, 1536, 576),
    (7, 40, 48),
    (8, 100, 64),
    (16, 48, 64),
    (17, 33, 80),
    (64, 33, 16),
    (65, 40, 32),
    (150, 72, 48),
]


def _fma_chain(x: torch.Tensor, w: torch.Tensor, bias: float | None, fused: bool = True) -> float:
    """x . w as the panel order defines it: from zero, one multiply-add per k in order, fused (the
    product of two float32 values is exact in float64, and the float64 sum rounded to float32 is the
    fused operation's result but in rare double-rounding cases, which these inputs do not hit) or,
    without FMA instructions, a rounded product and a rounded sum; then the bias added in float32."""
    acc = torch.zeros((), dtype=torch.float32)
    for xk, wk in zip(x.double(), w.double()):
        product = xk * wk if fused else (xk * wk).float().double()
        acc = (product + acc.double()).float()
    return (acc + bias).item() if bias is not None else acc.item()


def _check_panels(op, fused: bool = True) -> None:
    g = torch.Generator().manual_seed(1)
    for m, k, n in PANEL_SHAPES:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        panels = options.weight_panels(w)
        assert panels.shape == (n // 16, k, 16) and torch.equal(
            panels[1 % (n // 16), 3, 5], w[(1 % (n // 16)) * 16 + 5, 3]
        )
        for bias in (b, None):
            got = op(x, panels, bias)
            assert got.shape == (m, n)
            torch.testing.assert_close(got, _exact(x, w, bias), **TOLERANCE[torch.float32])
            for r in {0, m // 2, m - 1}:  # each row alone gives the bits it gets beside the others
                assert torch.equal(op(x[r : r + 1], panels, bias)[0], got[r]), (m, k, n, r)
        for r, c in ((0, 0), (m - 1, n - 1), (m // 2, n // 3)):  # the order: one chain over k, then the bias
            assert got[r, c].item() == _fma_chain(x[r], w[c], None, fused)
            assert op(x, panels, b)[r, c].item() == _fma_chain(x[r], w[c], b[c], fused)
    x = torch.randn(2, 3, 64, generator=g)  # leading dimensions, as a verify forward's [B, R, d]
    w = torch.randn(32, 64, generator=g)
    assert op(x, options.weight_panels(w), None).shape == (2, 3, 32)
    torch.testing.assert_close(op(x, options.weight_panels(w), None), _exact(x, w, None), **TOLERANCE[torch.float32])


def _builds_fused_multiply_add() -> bool:
    """Whether this machine's build has FMA instructions (x86 with AVX2 and FMA; the portable path
    elsewhere multiplies and adds with a rounding each)."""
    try:
        flags = next(ln for ln in open("/proc/cpuinfo").read().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return platform.machine() in ("x86_64", "AMD64") and "avx2" in flags and "fma" in flags


def test_weights_in_panels_give_the_product_as_one_chain_over_k_each_row_independently_of_the_others():
    native.load_native_kernels()
    _check_panels(torch.ops.harness.streaming_linear, fused=_builds_fused_multiply_add())


def test_weights_in_panels_are_refused_in_one_line_where_they_do_not_fit():
    native.load_native_kernels()
    op = torch.ops.harness.streaming_linear
    x, w = torch.randn(2, 8), torch.randn(32, 8)
    with pytest.raises(RuntimeError, match="float32 CPU input and bias of 32 features"):
        op(x.bfloat16(), options.weight_panels(w), None)
    with pytest.raises(RuntimeError, match="float32 CPU input and bias of 32 features"):
        op(x, options.weight_panels(w), torch.randn(16))
    with pytest.raises(RuntimeError, match=r"weight must be \[N, K\], float32 in panels .* or bfloat16 in pairs"):
        op(x, torch.randn(2, 8, 8), None)
    with pytest.raises(RuntimeError, match=r"weight must be \[N, K\], float32 in panels .* or bfloat16 in pairs"):
        op(x.bfloat16(), options.weight_panels(w).bfloat16(), None)
    with pytest.raises(RuntimeError, match="a bias of 32 features expected, got 16"):
        op(x, w, torch.randn(16))  # the [N, K] layout checks its bias as well
    assert op(x[:0], options.weight_panels(w), None).shape == (0, 32)
    b = torch.randn(32)
    assert torch.equal(op(torch.randn(3, 0), torch.randn(32, 0).reshape(2, 16, 0).transpose(1, 2), b), b.expand(3, 32))


# (M, K, N) for bfloat16 weights in pairs (K a multiple of 32, N of 16): one tile of rows against
# groups of four panels and a group cut short (3, 5 panels), two tiles of rows against pairs of panels
# and a lone one, a second pass of fewer than 32 rows that reads full tiles ending at the last row,
# recomputing rows of the first (33, 34, 40, 50, 61 rows), passes of 64 rows
PAIR_SHAPES = [
    (1, 576, 1536),
    (1, 64, 48),
    (2, 32, 16),
    (5, 1536, 576),
    (16, 64, 80),
    (17, 96, 48),
    (31, 32, 32),
    (32, 64, 64),
    (33, 64, 48),
    (34, 576, 48),
    (40, 32, 16),
    (48, 64, 32),
    (50, 96, 80),
    (61, 32, 16),
    (64, 32, 96),
    (65, 64, 32),
    (150, 96, 48),
]


def _check_pairs(op, on_amx: bool) -> None:
    """bfloat16 weights in pairs: the product to bfloat16 rounding, each row's bits the same alone,
    beside any other rows and in any pass; where the tiles are not used (``on_amx`` false), each element
    exactly one float32 chain of multiply-adds over k in order, then the bias, then one rounding."""
    g = torch.Generator().manual_seed(2)
    for m, k, n in PAIR_SHAPES:
        x, w, b = (torch.randn(*s, generator=g).bfloat16() for s in ((m, k), (n, k), (n,)))
        pairs = options.weight_panels(w)
        assert pairs.shape == (n // 16, k // 2, 16, 2) and pairs.dtype == torch.bfloat16
        p, c, kk = 1 % (n // 16), 5, 7
        assert torch.equal(pairs[p, kk // 2, c, kk % 2], w[16 * p + c, kk])
        for bias in (b, None):
            got = op(x, pairs, bias)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            torch.testing.assert_close(got, _exact(x, w, bias), **TOLERANCE[torch.bfloat16])
            for r in {0, m // 2, m - 1}:  # each row alone gives the bits it gets beside the others
                assert torch.equal(op(x[r : r + 1], pairs, bias)[0], got[r]), (m, k, n, r)
            for rows in {1, 16, 17, 33, 34, 49, m}:  # the first rows in fewer tiles or passes
                assert torch.equal(op(x[: min(rows, m)], pairs, bias), got[: min(rows, m)]), (m, k, n, rows)
        if not on_amx:
            for r, c in ((0, 0), (m - 1, n - 1), (m // 2, n // 3)):
                want = torch.tensor(_fma_chain(x[r].float(), w[c].float(), b[c].float().item())).bfloat16()
                assert op(x, pairs, b)[r, c] == want, (m, k, n, r, c)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()  # leading dimensions, as a verify forward's [B, R, d]
    w = torch.randn(32, 64, generator=g).bfloat16()
    assert op(x, options.weight_panels(w), None).shape == (2, 3, 32)
    torch.testing.assert_close(op(x, options.weight_panels(w), None), _exact(x, w, None), **TOLERANCE[torch.bfloat16])


def test_bfloat16_weights_in_pairs_give_the_product_each_row_independently_of_the_others():
    native.load_native_kernels()
    assert torch.ops.harness.pairs_on_amx() == native.pairs_on_amx()
    if native.cpu_has_amx() and native.cpp_compiler() is not None:
        assert native.pairs_on_amx()  # a CPU with AMX multiplies with its tiles (the compiler built them in)
    _check_pairs(torch.ops.harness.streaming_linear, on_amx=native.pairs_on_amx())


def test_weights_in_pairs_are_refused_in_one_line_where_they_do_not_fit():
    native.load_native_kernels()
    op = torch.ops.harness.streaming_linear
    x, w = torch.randn(2, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    pairs = options.weight_panels(w)
    with pytest.raises(RuntimeError, match="a weight in pairs takes a bfloat16 CPU input and bias of 32 features"):
        op(x.float(), pairs, None)
    with pytest.raises(RuntimeError, match="a weight in pairs takes a bfloat16 CPU input and bias of 32 features"):
        op(x, pairs, torch.randn(16).bfloat16())
    with pytest.raises(RuntimeError, match="a weight in pairs needs K a multiple of 32; got 48"):
        op(
            torch.randn(2, 48).bfloat16(),
            torch.randn(32, 48).bfloat16().reshape(2, 16, 24, 2).permute(0, 2, 1, 3),
            None,
        )
    assert op(x[:0], pairs, None).shape == (0, 32)
    assert not options.packable(torch.randn(32, 48).bfloat16())  # stays in the dot order
    assert options.packable(torch.randn(32, 48)) and not options.packable(torch.randn(24, 64).bfloat16())


def test_the_cpu_flags_say_whether_it_has_amx_tiles():
    spr = "vendor_id\t: GenuineIntel\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
    assert native.cpu_has_amx(spr)
    assert not native.cpu_has_amx(spr.replace(" amx_bf16", ""))
    assert not native.cpu_has_amx("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx512f avx512_bf16\n")


def test_a_weights_panels_are_made_once_and_again_when_the_weight_changes():
    w = torch.nn.Parameter(torch.randn(32, 8), requires_grad=False)
    first = options.weight_panels(w)
    assert options.weight_panels(w) is first  # kept on the weight
    with torch.no_grad():
        w.mul_(2)  # an in-place operation bumps the version
    again = options.weight_panels(w)
    assert again is not first and torch.equal(again, 2 * first)
    other = torch.nn.Linear(8, 32)
    other.load_state_dict({"weight": torch.ones(32, 8), "bias": torch.zeros(32)})
    options.weight_panels(other.weight)
    other.load_state_dict({"weight": torch.full((32, 8), 3.0), "bias": torch.zeros(32)})
    assert options.weight_panels(other.weight).eq(3.0).all()


def _rows_case(dh: int, dtype, rows: int = 9, start: int = 11) -> dict:
    """One layer's inputs for ``rows`` rows after ``start`` cached ones, heads of ``dh``, and a mask in
    which each row sees some of the prefix and of the rows before it, and itself (``dtype``
    "panels": float32 with the products' weights in panels)."""
    panels = dtype == "panels"
    dtype = torch.float32 if panels else dtype
    g = torch.Generator().manual_seed(dh)
    hq, hkv, d, inter = 4, 2, 48, 64 if panels else 40

    def rand(*shape):
        return (0.3 * torch.randn(*shape, generator=g)).to(dtype)

    weights = [1 + rand(d), rand(hq * dh, d), rand(hkv * dh, d), rand(hkv * dh, d), rand(d, hq * dh)]
    weights += [1 + rand(d), rand(inter, d), rand(inter, d), rand(d, inter)]
    if panels:
        weights = [w if w.dim() == 1 else options.weight_panels(w) for w in weights]
    angles = (3 * torch.randn(1, rows, dh // 2, generator=g)).repeat(1, 1, 2)
    sees = torch.rand(1, rows, start + rows, generator=g) < 0.6
    sees &= torch.ones(start + rows, start + rows, dtype=torch.bool).tril()[start:]  # nothing after itself
    sees[0, torch.arange(rows), start + torch.arange(rows)] = True
    return {
        "hidden": 3 * rand(1, rows, d),
        "cos": angles.cos().to(dtype),
        "sin": angles.sin().to(dtype),
        "keys": rand(1, hkv, start + rows, dh),
        "values": rand(1, hkv, start + rows, dh),
        "start": start,
        "weights": weights,
        "mask": sees,
    }


def _first_rows(case: dict, k: int, masked: bool) -> torch.Tensor:
    """The layer's output for the case's first ``k`` rows alone (on copies of its cache)."""
    start = case["start"]
    first = [case[n][:, :k].contiguous() for n in ("hidden", "cos", "sin")]
    mask = case["mask"][:, :k, : start + k].contiguous() if masked else None
    caches = case["keys"].clone(), case["values"].clone()
    dh = case["keys"].shape[-1]
    return torch.ops.harness.llama_layer(
        *first, mask, *caches, start, case["weights"], [None] * 7, 1e-5, 1e-6, dh**-0.5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "panels"])
def test_a_rows_attention_does_not_depend_on_the_rows_after_it(dtype):
    """Heads of 16, 32, 64 and 128 (attention in blocks of rows sharing each key load) and of 24 (one
    row at a time), causal and under a mask: the first k rows of a 9-row forward are the bits a
    forward of those k rows alone gives."""
    native.load_native_kernels()
    for dh in (16, 32, 64, 128, 24):
        case = _rows_case(dh, dtype)
        for masked in (False, True):
            full = _first_rows(case, 9, masked)
            for k in (1, 2, 3, 4, 5, 8):
                assert torch.equal(_first_rows(case, k, masked), full[:, :k]), (dh, k, masked)


def test_a_layer_with_weights_in_panels_computes_the_layer_and_refuses_a_mix_of_layouts():
    native.load_native_kernels()
    op = torch.ops.harness.llama_layer
    case = _rows_case(16, "panels")
    plain = {
        **case,
        "weights": [w if w.dim() == 1 else w.transpose(1, 2).reshape(-1, w.shape[1]) for w in case["weights"]],
    }

    def run(c, weights):
        caches = c["keys"].clone(), c["values"].clone()
        args = (c["hidden"], c["cos"], c["sin"], c["mask"], *caches, c["start"], weights, [None] * 7)
        return op(*args, 1e-5, 1e-6, 0.25)

    # the layouts sum each product in different orders (and the plain kernel's order depends on the
    # CPU's vector width): float32's summation-order tolerance, as for a product against float64
    torch.testing.assert_close(run(case, case["weights"]), run(plain, plain["weights"]), **TOLERANCE[torch.float32])
    for dh, rows in ((24, 1), (24, 3), (24, 8), (16, 2)):  # every tile family; q, k, v in one split cut short
        c = _rows_case(dh, "panels", rows=rows)
        flat = {
            **c,
            "weights": [w if w.dim() == 1 else w.transpose(1, 2).reshape(-1, w.shape[1]) for w in c["weights"]],
        }
        torch.testing.assert_close(run(c, c["weights"]), run(flat, flat["weights"]), **TOLERANCE[torch.float32])
    mixed = list(case["weights"])
    mixed[2] = plain["weights"][2]  # k in [N, K] beside q in panels
    with pytest.raises(RuntimeError, match="all float32 in panels"):
        run(case, mixed)


def test_the_layer_refuses_inputs_it_would_read_out_of_bounds():
    native.load_native_kernels()
    op = torch.ops.harness.llama_layer
    case = _layer_case(0, True)
    case[7][1] = torch.zeros(40, 39)  # q: one input feature short
    with pytest.raises(RuntimeError, match="llama_layer: weight 1 has shape"):
        op(*case, 1e-5, 1e-6, 0.3)
    case = _layer_case(0, True)
    case[8][4] = torch.zeros(24, dtype=torch.float64)  # the gate bias in another dtype
    with pytest.raises(RuntimeError, match="llama_layer: bias 4 must be"):
        op(*case, 1e-5, 1e-6, 0.3)
    case = _layer_case(0, True)
    case[3] = case[3][:, :, :-1].contiguous()  # a mask over fewer slots than the cache holds
    with pytest.raises(RuntimeError, match="mask must be bool"):
        op(*case, 1e-5, 1e-6, 0.3)


@contextlib.contextmanager
def _threads(n: int):
    """torch's thread count set to ``n`` for the block, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "panels"])
def test_the_result_does_not_depend_on_the_number_of_threads(dtype):
    native.load_native_kernels()
    op = torch.ops.harness.streaming_linear
    for rows in (1, 2, 3, 7, 16):  # each tile shape
        if dtype == "panels":  # 63 panels: groups of two cut short at the end
            x, w = torch.randn(rows, 576), options.weight_panels(torch.randn(1008, 576))
        else:  # 1000 rows: blocks of weight rows cut short at the end
            x, w = torch.randn(rows, 576, dtype=dtype), torch.randn(1000, 576, dtype=dtype)
        with _threads(1):
            one = op(x, w, None)
        with _threads(max(torch.get_num_threads(), 2)):
            assert torch.equal(op(x, w, None), one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "panels"])
def test_the_layer_gives_the_same_bits_on_one_thread_and_on_a_team_of_threads(dtype):
    native.load_native_kernels()
    op = torch.ops.harness.llama_layer
    outs = []
    for n in (1, max(torch.get_num_threads(), 2)):  # one thread: each split inline; more: one OpenMP team
        with _threads(n):
            if dtype == "panels":  # 1, 3 and 8 rows: each tile family of the panels
                for rows in (1, 3, 8):
                    c = _rows_case(24, "panels", rows=rows)
                    caches = c["keys"].clone(), c["values"].clone()
                    args = (c["hidden"], c["cos"], c["sin"], c["mask"], *caches, c["start"], c["weights"])
                    outs.append((op(*args, [None] * 7, 1e-5, 1e-6, 0.2), *caches))
            else:
                case = _layer_case(0, True, dtype)
                outs.append((op(*case, 1e-5, 1e-6, 0.3), case[4], case[5]))
    half = len(outs) // 2
    assert all(torch.equal(a, b) for one, team in zip(outs[:half], outs[half:]) for a, b in zip(one, team))


def _check_exp(op) -> None:
    x = torch.cat([torch.linspace(-87, 88, 20001), torch.tensor([-1e4, -87.5, -float("inf"), 88.5, 1e4, 0.0])])
    y = op(x)
    exact = torch.exp(x[:20001].double())
    rel = ((y[:20001].double() - exact) / exact).abs().max().item()
    assert rel < 2**-22, rel  # within 2 units in the last place over the whole range (measured: 0.64)
    special = y[20001:]  # below the smallest normal result, -inf: 0; past the largest float: inf
    assert special[:3].eq(0).all() and special[3:5].isinf().all() and special[5] == 1.0
    for n in (1, 5, 17, 33):  # an element's result does not depend on the array it sits in
        for start in (0, 3, 20000 - n):
            assert torch.equal(op(x[start : start + n]), y[start : start + n])


def test_the_layers_exp_is_accurate_and_does_not_depend_on_where_an_element_sits():
    native.load_native_kernels()
    _check_exp(torch.ops.harness.vector_exp)


def test_other_dtypes_fall_back_to_torch_linear():
    native.load_native_kernels()
    for dtype in (torch.float64, torch.float16):
        x, w = torch.randn(2, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
        assert torch.equal(torch.ops.harness.streaming_linear(x, w, None), F.linear(x, w))


def test_a_bfloat16_layer_stays_within_bfloat16_rounding_of_the_float32_layer_and_refuses_mixed_dtypes():
    """The bfloat16 layer against the float32 layer on the same (bfloat16-valued) inputs. The outputs
    reach 15 in magnitude, where one bfloat16 unit is 0.0625; PyTorch's own bfloat16 operators, composed
    as transformers' layer composes them, land 0.13-0.16 from the float32 layer on these inputs (the
    layer against transformers' own bfloat16 layers: test_fused_layers)."""
    native.load_native_kernels()
    op = torch.ops.harness.llama_layer
    for seed, masked in ((0, True), (1, False)):
        half, full = _layer_case(seed, masked, torch.bfloat16), _layer_case(seed, masked, torch.bfloat16)
        full = [[t.float() if t is not None else None for t in c] if isinstance(c, list) else c for c in full]
        full = [c.float() if isinstance(c, torch.Tensor) and c.is_floating_point() else c for c in full]
        out = op(*half, 1e-5, 1e-6, 0.3)
        torch.testing.assert_close(out.float(), op(*full, 1e-5, 1e-6, 0.3), rtol=2**-6, atol=0.25)
        torch.testing.assert_close(half[4].float(), full[4], rtol=2**-6, atol=2**-6)  # keys: one rounding
    case = _layer_case(0, True, torch.bfloat16)
    case[1] = case[1].float()  # cos in float32 beside bfloat16 hidden states
    with pytest.raises(RuntimeError, match="in the hidden states' dtype"):
        op(*case, 1e-5, 1e-6, 0.3)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="instruction-set variants of x86")
def test_every_code_path_it_ships_computes_the_same_product(tmp_path):
    """AVX-512 without AVX512-BF16 (bfloat16 widened to float32), AVX-512 with float32 products in
    the vector width this CPU's build does not use (256 or 512 bits), the AVX2 path (CPUs without
    AVX-512), the portable one (neither AVX2 nor AVX-512, e.g. ARM) and a build without AMX tiles
    (bfloat16 weights in pairs in the portable chain), built here under their own op namespaces and
    checked as the real build is, in float32 and bfloat16."""
    other_width = 512 if native.float32_width() == 256 else 256
    variants = {
        "harness_avx512": ("-mno-avx512bf16",),  # AVX-512 without its bfloat16 dot products
        "harness_f32_other": (f"-DHARNESS_F32_WIDTH={other_width}",),
        "harness_avx2": ("-mno-avx512f",),
        "harness_portable": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),
        "harness_no_amx": ("-mno-amx-tile", "-mno-amx-bf16"),  # bfloat16 pairs in the portable chain
    }
    built, errors = {}, []

    def one(namespace, flags):
        try:
            built[namespace] = native.build(namespace=namespace, extra_flags=flags, out_dir=tmp_path)
        except native.NativeBuildError as exc:
            errors.append(str(exc))

    workers = [threading.Thread(target=one, args=item) for item in variants.items()]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors
    native.load_native_kernels()
    for namespace, library in built.items():
        torch.ops.load_library(str(library))
        for dtype in (torch.float32, torch.bfloat16):
            _check_product(getattr(torch.ops, namespace).streaming_linear, dtype)
            _check_layer(getattr(torch.ops, namespace).llama_layer, torch.ops.harness.llama_layer, dtype)
        _check_panels(getattr(torch.ops, namespace).streaming_linear, fused=namespace != "harness_portable")
        if namespace == "harness_f32_other":  # the other vector width: each element the same chain, the same bits
            g = torch.Generator().manual_seed(2)
            for m, k, n in PANEL_SHAPES:
                x, panels = torch.randn(m, k, generator=g), options.weight_panels(torch.randn(n, k, generator=g))
                bias = torch.randn(n, generator=g)
                other = getattr(torch.ops, namespace).streaming_linear(x, panels, bias)
                assert torch.equal(other, torch.ops.harness.streaming_linear(x, panels, bias))
        ops = getattr(torch.ops, namespace)
        _check_pairs(ops.streaming_linear, on_amx=ops.pairs_on_amx())
        _check_exp(getattr(torch.ops, namespace).vector_exp)


def test_a_build_that_fails_is_one_line_and_a_missing_compiler_is_named(tmp_path, monkeypatch):
    with pytest.raises(native.NativeBuildError, match=r"could not build cpu_decode.cpp: .*error") as err:
        native.build(namespace="harness_broken", extra_flags=("-DHARNESS_NAMESPACE=", "-x", "c"), out_dir=tmp_path)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())  # nothing half-written left behind
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeBuildError, match="no C\\+\\+ compiler found"):
        native.build(out_dir=tmp_path)


def test_the_float32_width_is_256_bits_on_zen_4_only():
    zen4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
    zen5 = zen4.replace(": 25", ": 26")
    xeon = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
    assert [native.float32_width(t) for t in (zen4, zen5, xeon, "")] == [256, 512, 512, 512]


def test_a_build_is_reused_until_its_inputs_change(tmp_path, monkeypatch):
    import subprocess

    first = native.build(out_dir=tmp_path)
    version = subprocess.CompletedProcess(args=[], returncode=0, stdout=native._compiler_version(native.cpp_compiler()))
    calls = []
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: calls.append(a[0]) or version)
    assert native.build(out_dir=tmp_path) == first
    assert all(c[-1] == "--version" for c in calls)  # the compiler was at most asked its version, never to build
    monkeypatch.setattr(native, "_cpu_fingerprint", lambda: "another CPU")  # what -march=native builds for
    assert native.build(out_dir=tmp_path) != first
    assert calls[-1][0] == native.cpp_compiler() and "-march=native" in calls[-1]  # a new key: a build
    assert f"-DHARNESS_F32_WIDTH={native.float32_width()}" in calls[-1]  # the width chosen for this CPU


def test_the_streaming_kernel_is_refused_in_one_line_where_it_cannot_run(monkeypatch):
    assert options.linear_kernel_problem("streaming", torch.bfloat16, "cpu") is None
    assert "float32 and bfloat16" in options.linear_kernel_problem("streaming", torch.float16, "cpu")
    assert "CPU kernel" in options.linear_kernel_problem("streaming", torch.float32, "cuda")
    monkeypatch.setattr(options, "native_kernels_problem", lambda: "no C++ compiler found (install g++ or set $CXX)")
    problem = options.linear_kernel_problem("streaming", torch.float32, "cpu")
    assert problem.startswith("model.linear_kernel=streaming cannot run here: no C++ compiler found")
    assert "model.linear_kernel=weight_major" in problem and "\n" not in problem


def test_a_linear_layer_that_needs_gradients_is_computed_by_autograd():
    native.load_native_kernels()
    layer = torch.nn.Linear(16, 4)
    options.apply_linear_kernel(layer, "streaming")
    x = torch.randn(3, 16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(layer(x.detach()), F.linear(x.detach(), layer.weight, layer.bias))


def _attention_case(dh: int, rows: int, start: int, masked: bool, dtype) -> list:
    """``llama_layer``'s arguments for a batch of 2, 6 query heads over 2 key heads (as SmolLM2
    groups them), ``rows`` rows after ``start`` cached ones; under a mask, each row sees a random part
    of the prefix (with runs of unseen keys) and of the rows before it, and itself."""
    g = torch.Generator().manual_seed(1000 * dh + 10 * rows + start)
    hq, hkv, d, inter, b = 6, 2, 48, 40, 2

    def rand(*shape, scale=0.3):
        return (scale * torch.randn(*shape, generator=g)).to(dtype)

    weights = [1 + rand(d), rand(hq * dh, d), rand(hkv * dh, d), rand(hkv * dh, d), rand(d, hq * dh)]
    weights += [1 + rand(d), rand(inter, d), rand(inter, d), rand(d, inter)]
    angles = (3 * torch.randn(b, rows, dh // 2, generator=g)).repeat(1, 1, 2)
    mask = None
    if masked:
        mask = torch.rand(b, rows, start + rows, generator=g) < 0.8
        mask[:, :, start // 3 : start // 2] = False  # a run every row skips
        mask &= torch.ones(start + rows, start + rows, dtype=torch.bool).tril()[start:]
        mask[:, torch.arange(rows), start + torch.arange(rows)] = True
    caches = [rand(b, hkv, start + rows, dh, scale=1.0) for _ in range(2)]
    hidden = rand(b, rows, d, scale=3.0)
    return [hidden, angles.cos().to(dtype), angles.sin().to(dtype), mask, *caches, start, weights, [None] * 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dh", [32, 64, 128])
def test_a_masked_row_is_the_bits_of_its_own_keys_in_order_decoded_alone(dtype, dh):
    """A row under a mask attends to keys scattered over the cache (runs of unseen keys, a hole
    before most of its keys, rows of the same forward): its output must be the bits of the same
    query decoded alone after exactly its keys, in order, in a cache of their own (the sequential
    decode of its path). Prefixes up to 300 keys, so on AMX bfloat16 heads of a multiple of 32 take
    several tile steps over the values and rows whose tile keys run past a hole gather their own."""
    native.load_native_kernels()
    layer = torch.ops.harness.llama_layer
    for rows, start in ((5, 40), (9, 70), (12, 150), (6, 300)):
        case = _attention_case(dh, rows, start, True, dtype)
        mask = case[3]
        out = layer(*case, 1e-5, 1e-6, dh**-0.5)
        keys, values = case[4], case[5]  # this forward's rows now appended
        for b in range(mask.shape[0]):
            for r in range(rows):
                seen = mask[b, r].nonzero().flatten()
                assert int(seen[-1]) == start + r  # the row itself, last
                alone = _attention_case(dh, rows, start, True, dtype)
                alone[0] = case[0][b : b + 1, r : r + 1].contiguous()
                alone[1], alone[2] = (t[b : b + 1, r : r + 1].contiguous() for t in case[1:3])
                alone[3] = None
                alone[4], alone[5] = (t[b : b + 1, :, seen].contiguous() for t in (keys, values))
                alone[6] = len(seen) - 1
                got = layer(*alone, 1e-5, 1e-6, dh**-0.5)
                assert torch.equal(got[0, 0], out[b, r]), (b, r, rows, start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dh", [12, 32, 64, 128])
def test_a_row_that_sees_no_key_attends_to_nothing_as_sdpa_does(dtype, dh):
    """A row whose mask allows no key (a padded row) divided its value sum by a total of 0: NaN, where
    torch's SDPA gives 0. It must give what a row seeing one key whose value is zero gives (an attention
    output of exactly 0), bit for bit, and leave the other rows as they are."""
    native.load_native_kernels()
    layer = torch.ops.harness.llama_layer
    rows, start, zero_key = 5, 40, 7

    def run(sees_zero_key: bool) -> torch.Tensor:
        case = _attention_case(dh, rows, start, True, dtype)
        case[5][:, :, zero_key] = 0  # that key's value
        case[3][0, 2] = False
        case[3][0, 2, zero_key] = sees_zero_key
        return layer(*case, 1e-5, 1e-6, dh**-0.5)

    nothing, zero = run(False), run(True)
    assert torch.isfinite(nothing).all()
    assert torch.equal(nothing, zero)
    sdpa = F.scaled_dot_product_attention(
        torch.randn(1, 1, 2, 8),
        torch.randn(1, 1, 3, 8),
        torch.randn(1, 1, 3, 8),
        attn_mask=torch.tensor([[True] * 3, [False] * 3]),
    )
    assert torch.equal(sdpa[0, 0, 1], torch.zeros(8))  # what transformers' SDPA layer gives such a row


@pytest.mark.skipif(
    not native.pairs_on_amx(), reason="bfloat16 attention runs on AMX tiles only where the CPU has them"
)
def test_bfloat16_attention_on_amx_tiles_follows_attention_in_vectors_and_keeps_rows_apart(tmp_path):
    """Where the CPU has AMX, bfloat16 attention over heads of a multiple of 32 runs on its tiles
    (scores, and value sums over probabilities rounded to bfloat16 for all but a row's last 32 to 63
    keys). The layer follows a build that keeps attention in float32 vectors to bfloat16 rounding,
    for heads of 32 to 256 dimensions, causal and under a mask, from one row to more query heads
    than one tile of rows, over prefixes of several tile steps; and a causal forward's first rows are
    the bits a forward of only those rows gives."""
    library = native.build(
        namespace="harness_attention_in_vectors", extra_flags=("-DHARNESS_NO_TILE_ATTENTION",), out_dir=tmp_path
    )
    native.load_native_kernels()
    torch.ops.load_library(str(library))
    tiles, vectors = torch.ops.harness.llama_layer, torch.ops.harness_attention_in_vectors.llama_layer
    shapes = ((1, 0), (1, 70), (2, 11), (3, 130), (9, 70), (20, 33), (40, 200), (1, 500))  # (rows, start)
    differ = []
    for dh in (32, 64, 96, 128, 256):
        for rows, start in shapes:
            for masked in (False, True):
                a, b = (_attention_case(dh, rows, start, masked, torch.bfloat16) for _ in range(2))
                out_a, out_b = tiles(*a, 1e-5, 1e-6, dh**-0.5), vectors(*b, 1e-5, 1e-6, dh**-0.5)
                assert out_a.isfinite().all()
                torch.testing.assert_close(out_a.float(), out_b.float(), rtol=2**-5, atol=0.25)
                if start >= 130:  # every row has tile keys: the other rounding shows somewhere
                    differ.append(not torch.equal(out_a, out_b))
                if not masked and rows > 1:
                    first = _attention_case(dh, rows, start, masked, torch.bfloat16)
                    k = rows // 2
                    first[0] = first[0][:, :k].contiguous()
                    first[1], first[2] = first[1][:, :k].contiguous(), first[2][:, :k].contiguous()
                    assert torch.equal(tiles(*first, 1e-5, 1e-6, dh**-0.5), out_a[:, :k]), (dh, rows, start)
    assert sum(differ) >= 0.8 * len(differ), differ  # the tiles did run


def test_grouped_attention_gives_the_bits_of_attention_one_query_head_at_a_time(tmp_path):
    """The default build computes the heads of a key head together (its scores, softmax and value sums
    split over runs of keys and slices of the head); a build that never groups computes each query head
    on its own. Both must give the same bits, cache included, for every head width, causal and under a
    mask, from one row to a verify forward's, over prefixes shorter and longer than one run of keys,
    in float32 and bfloat16. (Where the CPU has AMX, bfloat16 heads of a multiple of 32 run on its
    tiles by default, so both builds here keep attention in vectors.)"""
    in_vectors = ("-DHARNESS_NO_TILE_ATTENTION",)
    library = native.build(
        namespace="harness_ungrouped",
        extra_flags=("-DHARNESS_GROUPED_ATTENTION_BYTES=0", *in_vectors),
        out_dir=tmp_path,
    )
    native.load_native_kernels()
    torch.ops.load_library(str(library))
    grouped, ungrouped = torch.ops.harness.llama_layer, torch.ops.harness_ungrouped.llama_layer
    if native.pairs_on_amx():
        torch.ops.load_library(str(native.build(namespace="harness_grouped", extra_flags=in_vectors, out_dir=tmp_path)))
        grouped = torch.ops.harness_grouped.llama_layer
    shapes = ((1, 0), (1, 70), (2, 11), (3, 130), (9, 70))  # (rows, start)
    cases = [(dh, r, s, masked) for dh in (8, 16, 32, 64, 128) for r, s in shapes for masked in (False, True)]
    for dtype in (torch.float32, torch.bfloat16):
        for dh, rows, start, masked in cases:
            a, b = (_attention_case(dh, rows, start, masked, dtype) for _ in range(2))
            out_a, out_b = grouped(*a, 1e-5, 1e-6, dh**-0.5), ungrouped(*b, 1e-5, 1e-6, dh**-0.5)
            assert torch.equal(out_a, out_b), (dtype, dh, rows, start, masked)
            assert torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])
            assert out_a.isfinite().all()


def test_the_phase_times_build_computes_the_same_bits_and_counts_every_layer_and_block(tmp_path):
    """``scripts/layer_phases.py`` reads where a layer's time goes from a build with
    ``-DHARNESS_PHASE_TIMES``: its layers must give the default build's bits (the timers only read
    the clock), thread 0 must count each layer once and time each of its ten steps, no step's time
    may exceed the wall time of the calls, and a read starts the counters again."""
    library = native.build(namespace="harness_phase_times", extra_flags=("-DHARNESS_PHASE_TIMES",), out_dir=tmp_path)
    native.load_native_kernels()
    torch.ops.load_library(str(library))
    timed, plain = torch.ops.harness_phase_times, torch.ops.harness
    timed.layer_phase_times()
    calls, wall = 0, 0.0
    for dtype in (torch.float32, torch.bfloat16):
        for rows, start in ((1, 40), (5, 70)):
            a, b = (_attention_case(64, rows, start, True, dtype) for _ in range(2))
            t0 = time.perf_counter()
            out = timed.llama_layer(*a, 1e-5, 1e-6, 0.125)
            wall += time.perf_counter() - t0
            calls += 1
            assert torch.equal(out, plain.llama_layer(*b, 1e-5, 1e-6, 0.125)), (dtype, rows, start)
            assert torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])  # the cache appends too
    counters = timed.layer_phase_times()
    assert counters.shape == (64, 17)
    assert counters[0, 0] == calls  # thread 0 runs every layer
    steps = counters[0, 2:12]
    assert (steps > 0).all() and float(steps.sum()) <= wall
    if native.pairs_on_amx():  # bfloat16 attention on tiles: blocks counted and their parts timed
        assert counters[:, 1].sum() > 0 and (counters[:, 12:].sum(0) > 0).all()
    else:
        assert counters[:, 1].sum() == 0 and counters[:, 12:].sum() == 0
    assert timed.layer_phase_times().abs().sum() == 0  # read: started again
