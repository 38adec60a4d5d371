"""stax.conv2d (§9.8 convolution): eager im2col + BLAS, the CPU fallback kernel, the GPU's
implicit-GEMM template (Triton's interpreter without a GPU), errors in PyTorch's words.

Every result is compared with a float64 direct convolution (a loop over the kernel taps, no
im2col) on fresh random inputs.
"""
import numpy as np
import pytest

import stax
from conftest import assert_close, run_outside_interpreter


def direct_conv(x, w, b=None, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1), groups=1):
    """float64 reference: out[n, co, oh, ow] = b[co] + Σ_{c, i, j} w[co, c, i, j] · xp[n, g·Cg + c,
    oh·sh + i·dh, ow·sw + j·dw], one tap (i, j) at a time."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, c, h, wd = x.shape
    c_out, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0)) + tuple(padding))
    oh = (xp.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (xp.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    out = np.zeros((n, c_out, oh, ow))
    cog = c_out // groups
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                r0, c0 = i * dilation[0], j * dilation[1]
                patch = xp[:, g * cg:(g + 1) * cg, r0:r0 + stride[0] * (oh - 1) + 1:stride[0],
                           c0:c0 + stride[1] * (ow - 1) + 1:stride[1]]
                out[:, g * cog:(g + 1) * cog] += np.einsum("nchw,oc->nohw", patch, w[g * cog:(g + 1) * cog, :, i, j])
    if b is not None:
        out += np.asarray(b, np.float64).reshape(1, -1, 1, 1)
    return out


def f64(t):
    return np.asarray((t.float() if t.dtype is stax.bfloat16 else t).numpy(), np.float64)


def _pad4(p):
    p = (p, p) if isinstance(p, int) else p
    return ((p[0], p[0]), (p[1], p[1]))


def _pair(v):
    return (v, v) if isinstance(v, int) else v


# (N, C, H, W), (C_out, KH, KW), stride, padding, dilation, groups, bias
CASES = {
    "1x1_pixel": ((1, 1, 1, 1), (1, 1, 1), 1, 0, 1, 1, False),
    "odd_3x3_pad": ((2, 3, 7, 9), (5, 3, 3), 1, 1, 1, 1, True),
    "stride2_rect": ((2, 4, 11, 10), (6, 3, 5), 2, (1, 2), 1, 2, True),
    "stride_2_1": ((1, 3, 9, 8), (4, 2, 3), (2, 1), (0, 1), 1, 1, True),
    "dilation": ((1, 6, 13, 12), (6, 3, 3), 1, 2, 2, 6, False),
    "depthwise_stride2": ((2, 5, 9, 7), (5, 3, 3), 2, 1, 1, 5, True),
    "depthwise_multiplier": ((1, 3, 8, 8), (6, 3, 3), 1, 1, 1, 3, True),
    "pointwise_1x1_s2": ((3, 5, 8, 7), (7, 1, 1), 2, 0, 1, 1, True),
    "big_kernel_dil": ((1, 2, 16, 17), (3, 7, 5), 3, (3, 2), (2, 3), 1, False),
    # 16 or more channels per group: the GPU template's tap-major K loop
    "taps_groups_dil": ((2, 32, 9, 8), (8, 3, 3), 2, (1, 0), (1, 2), 2, True),
    "taps_1x1_odd_c": ((1, 40, 5, 7), (12, 1, 1), 1, 0, 1, 1, False),
}


def _inputs(rng, xs, ws, groups, bias, dtype=stax.float32):
    n, c = xs[:2]
    x = stax.tensor(rng.standard_normal(xs), dtype=stax.float32).to(dtype)
    w = stax.tensor(rng.standard_normal((ws[0], c // groups) + ws[1:]), dtype=stax.float32).to(dtype)
    b = stax.tensor(rng.standard_normal(ws[0]), dtype=stax.float32).to(dtype) if bias else None
    return x, w, b


# ---- eager ----


@pytest.mark.parametrize("case", list(CASES))
def test_eager_matches_the_direct_loop(case, rng):
    xs, ws, stride, pad, dil, groups, bias = CASES[case]
    x, w, b = _inputs(rng, xs, ws, groups, bias)
    out = stax.conv2d(x, w, b, stride=stride, padding=pad, dilation=dil, groups=groups)
    ref = direct_conv(f64(x), f64(w), None if b is None else f64(b), _pair(stride), _pad4(pad), _pair(dil), groups)
    assert out.shape == ref.shape and out.dtype is stax.float32 and out.is_contiguous()
    assert_close(out, ref, stax.float32)


@pytest.mark.parametrize("dtype", [stax.float16, stax.bfloat16, stax.float64])
def test_eager_half_and_double(dtype, rng):
    x, w, b = _inputs(rng, (2, 4, 9, 7), (6, 3, 3), 2, True, dtype)
    out = stax.conv2d(x, w, b, stride=2, padding=1, groups=2)
    assert out.dtype is dtype
    assert_close(out.double(), direct_conv(f64(x), f64(w), f64(b), (2, 2), _pad4(1), (1, 1), 2), dtype)


def test_eager_channels_last_strided_views_and_empty(rng):
    x_nhwc = stax.tensor(rng.standard_normal((2, 7, 6, 4)), dtype=stax.float32)
    x = x_nhwc.permute(0, 3, 1, 2)                     # NCHW shape, NHWC memory
    w = stax.tensor(rng.standard_normal((3, 3, 4, 5)), dtype=stax.float32).permute(3, 2, 0, 1)  # [5, 4, 3, 3]
    b = stax.tensor(rng.standard_normal(10), dtype=stax.float32)[::2]
    assert not x.is_contiguous() and not w.is_contiguous()
    out = stax.conv2d(x, w, b, padding=1)
    assert_close(out, direct_conv(f64(x), f64(w), f64(b), padding=_pad4(1)), stax.float32)
    # empty batch, zero channels (an empty sum: only the bias), unbatched input
    assert stax.conv2d(stax.randn(0, 4, 5, 5), w).shape == (0, 5, 3, 3)
    z = stax.conv2d(stax.randn(1, 0, 5, 5), stax.randn(3, 0, 3, 3), b[:3])
    assert_close(z, np.broadcast_to(f64(b[:3]).reshape(1, 3, 1, 1), (1, 3, 3, 3)), stax.float32)
    x3 = stax.randn(4, 6, 5)
    assert_close(stax.conv2d(x3, w, b), direct_conv(f64(x3)[None], f64(w), f64(b))[0], stax.float32)


def test_eager_padding_strings_and_specials(rng):
    x = stax.tensor(rng.standard_normal((1, 2, 6, 7)), dtype=stax.float32)
    w = stax.tensor(rng.standard_normal((3, 2, 4, 3)), dtype=stax.float32)
    same = stax.conv2d(x, w, padding="same", dilation=(1, 2))    # total (3, 4): PyTorch pads (1, 2), (2, 2)
    assert same.shape == (1, 3, 6, 7)
    assert_close(same, direct_conv(f64(x), f64(w), padding=((1, 2), (2, 2)), dilation=(1, 2)), stax.float32)
    assert_close(stax.conv2d(x, w, padding="valid"), direct_conv(f64(x), f64(w)), stax.float32)
    xs = f64(x).copy()
    xs[0, 0, 2, 3], xs[0, 1, 5, 0] = np.nan, np.inf
    xn = stax.tensor(xs, dtype=stax.float32)
    assert_close(stax.conv2d(xn, w, padding=1), direct_conv(xs, f64(w), padding=_pad4(1)), stax.float32)


@pytest.mark.parametrize("args, kwargs, error, message", [
    (((2, 3, 8, 8), (4, 2, 3, 3)), {}, RuntimeError,
     r"Given groups=1, weight of size \[4, 2, 3, 3\], expected input\[2, 3, 8, 8\] to have 2 channels, but got 3"),
    (((2, 4, 8, 8), (3, 2, 3, 3)), {"groups": 2}, RuntimeError,
     r"expected weight to be divisible by 2 at dimension 0, but got weight of size \[3, 2, 3, 3\]"),
    (((1, 2, 2, 2), (1, 2, 3, 3)), {}, RuntimeError,
     r"Calculated padded input size per channel: \(2 x 2\). Kernel size: \(3 x 3\)"),
    (((2, 8, 8), (1, 2, 3)), {}, RuntimeError, "weight should have 4 dimensions"),
    (((8, 8), (1, 1, 3, 3)), {}, RuntimeError, r"Expected 3D \(unbatched\) or 4D \(batched\) input to conv2d"),
    (((1, 1, 8, 8), (1, 1, 3, 3)), {"stride": 0}, RuntimeError, "non-positive stride is not supported"),
    (((1, 1, 8, 8), (1, 1, 3, 3)), {"padding": -1}, RuntimeError, "negative padding is not supported"),
    (((1, 1, 8, 8), (1, 1, 3, 3)), {"dilation": (1, 0)}, RuntimeError, "dilation should be greater than zero"),
    (((1, 1, 8, 8), (1, 1, 3, 3)), {"groups": 0}, RuntimeError, "non-positive groups is not supported"),
    (((1, 1, 8, 8), (1, 1, 3, 3)), {"padding": "full"}, ValueError, "Invalid padding string 'full'"),
    (((1, 1, 8, 8), (1, 1, 3, 3)), {"padding": "same", "stride": 2}, ValueError,
     "padding='same' is not supported for strided convolutions"),
    (((1, 1, 8, 8), (1, 1, 3, 3)), {"stride": (1, 2, 3)}, TypeError, "argument 'stride' must be an int or a tuple"),
])
def test_errors_say_what_was_wrong(args, kwargs, error, message):
    x, w = stax.randn(*args[0]), stax.randn(*args[1])
    with pytest.raises(error, match=message):
        stax.conv2d(x, w, **kwargs)


def test_dtype_and_bias_errors():
    x, w = stax.randn(1, 2, 5, 5), stax.randn(3, 2, 3, 3)
    with pytest.raises(RuntimeError, match=r"Input type \(float\) and weight type \(half\) should be the same"):
        stax.conv2d(x, w.half())
    with pytest.raises(RuntimeError, match=r"expected bias to be 1-dimensional with 3 elements, but got bias of size \[4\]"):
        stax.conv2d(x, w, stax.randn(4))
    with pytest.raises(RuntimeError, match="expected a floating-point input"):
        stax.conv2d(x.long(), w.long())


# ---- compiled on the CPU: the im2col + BLAS fallback kernel, operands read in place ----


def test_compiled_cpu_equals_eager_and_reads_channels_last_in_place(rng):
    fn = lambda x, w, b: stax.relu(stax.conv2d(x, w, b, stride=2, padding=1, groups=2)) * 2
    x = stax.tensor(rng.standard_normal((2, 9, 7, 6)), dtype=stax.float32).permute(0, 3, 1, 2)
    w = stax.tensor(rng.standard_normal((4, 3, 3, 3)), dtype=stax.float32)
    b = stax.tensor(rng.standard_normal(4), dtype=stax.float32)
    cf = stax.compile(fn)
    out = cf(x, w, b)
    ref = np.maximum(direct_conv(f64(x), f64(w), f64(b), (2, 2), _pad4(1), (1, 1), 2), 0) * 2
    assert_close(out, ref, stax.float32)
    np.testing.assert_array_equal(out.numpy(), fn(x, w, b).numpy())
    wrapper = cf.last_generated.wrapper     # the channels-last input goes to the kernel as it is
    assert "assert_size_stride(arg0_1, (2, 6, 9, 7), (378, 1, 42, 6))" in wrapper
    assert "extern_kernel('conv2d', [arg0_1, arg1_1, arg2_1]" in wrapper


# ---- compiled on the GPU: the implicit-GEMM template (Triton's interpreter without a GPU) ----


def _run_gpu(fn, *args):
    dev = [a.to("cuda") if isinstance(a, stax.Tensor) else a for a in args]
    cf = stax.compile(fn)
    return cf(*dev).cpu(), cf.last_generated


@pytest.mark.parametrize("case", ["odd_3x3_pad", "stride2_rect", "depthwise_stride2", "pointwise_1x1_s2",
                                  "big_kernel_dil", "taps_groups_dil", "taps_1x1_odd_c"])
def test_gpu_template_matches_the_direct_loop(case, rng):
    xs, ws, stride, pad, dil, groups, bias = CASES[case]
    x, w, b = _inputs(rng, xs, ws, groups, bias)
    kw = dict(stride=stride, padding=pad, dilation=dil, groups=groups)
    if b is None:
        out, gen = _run_gpu(lambda x, w: stax.conv2d(x, w, **kw), x, w)
    else:
        out, gen = _run_gpu(lambda x, w, b: stax.conv2d(x, w, b, **kw), x, w, b)
    ref = direct_conv(f64(x), f64(w), None if b is None else f64(b), _pair(stride), _pad4(pad), _pair(dil), groups)
    assert_close(out, ref, stax.float32)
    assert list(gen.kernels) == ["triton_tem_fused_conv_0"]
    src = gen.kernels["triton_tem_fused_conv_0"]
    assert 'input_precision="ieee"' in src and ("bias = tl.load" in src) == bias
    assert ("for t in range(" in src) == (xs[1] // groups >= 16)       # tap loop, else flat K
    assert ("(ih >= 0)" in src) == (_pad4(pad)[0][0] > 0)               # window tests only for padding


@pytest.mark.parametrize("dtype", [stax.float16, stax.bfloat16])
def test_gpu_template_half_types_channels_last(dtype, rng):
    x_nhwc = stax.tensor(rng.standard_normal((2, 6, 5, 24)), dtype=stax.float32).to(dtype)
    w = stax.tensor(rng.standard_normal((16, 24, 3, 3)), dtype=stax.float32).to(dtype)
    b = stax.tensor(rng.standard_normal(16), dtype=stax.float32).to(dtype)
    cf = stax.compile(lambda x, w, b: stax.conv2d(x, w, b, padding=1))
    x_dev = x_nhwc.to("cuda").permute(0, 3, 1, 2)      # channels-last on the device, read in place
    out = cf(x_dev, w.to("cuda"), b.to("cuda")).cpu()
    x = x_nhwc.permute(0, 3, 1, 2)
    assert out.dtype is dtype
    assert_close(out.double(), direct_conv(f64(x), f64(w), f64(b), padding=_pad4(1)), dtype)
    src = cf.last_generated.kernels["triton_tem_fused_conv_0"]
    # taps × channel blocks, channels read along their contiguous dimension
    assert "a_row = x_row + ih * 120 + iw * 24" in src and "(a_row[:, None] + rc[None, :])" in src
    assert "input_precision" not in src


def test_gpu_template_flat_loop_reads_channels_last_in_memory_order(rng):
    x_nhwc = stax.tensor(rng.standard_normal((2, 7, 6, 6)), dtype=stax.float32)
    w, b = stax.randn(5, 6, 3, 3), None
    cf = stax.compile(lambda x, w: stax.conv2d(x, w, stride=2, padding=(0, 1)))
    out = cf(x_nhwc.to("cuda").permute(0, 3, 1, 2), w.to("cuda")).cpu()
    x = x_nhwc.permute(0, 3, 1, 2)
    assert_close(out, direct_conv(f64(x), f64(w), b, (2, 2), _pad4((0, 1))), stax.float32)
    src = cf.last_generated.kernels["triton_tem_fused_conv_0"]
    assert "c_k = rk % 6" in src and "kh_k = (rk // 18)" in src        # K order (kh, kw, c)
    assert "(ih >= 0)" not in src and "(iw >= 0) & (iw < 6)" in src


def test_gpu_fallbacks_epilogue_and_specials(rng):
    x, w, b = _inputs(rng, (1, 3, 6, 5), (4, 3, 3), 1, True)
    xs = f64(x).copy()
    xs[0, 1, 2, 2] = np.nan
    x = stax.tensor(xs, dtype=stax.float32)
    out, gen = _run_gpu(lambda x, w, b: stax.relu(stax.conv2d(x, w, b, padding=1)), x, w, b)
    ref = np.maximum(direct_conv(xs, f64(w), f64(b), padding=_pad4(1)), 0)     # NaN stays NaN
    assert np.isnan(ref).any()
    assert_close(out, ref, stax.float32)
    assert "triton_tem_fused_conv_0" in gen.kernels
    # float64 has no template: the host fallback runs (compiled still equals eager)
    x64, w64 = x.double(), w.double()
    out, gen = _run_gpu(lambda x, w: stax.conv2d(x, w, stride=2), x64, w64)
    assert "extern_kernel('conv2d'" in gen.wrapper and not gen.kernels
    assert_close(out, direct_conv(xs, f64(w), stride=(2, 2)), stax.float64)


SM90_BUILD = """
import json, sys
from stax.triton_heuristics import candidates, kernel_from_source
out = {}
for path in sys.argv[1:]:
    name, source = json.loads(open(path).read())
    k = kernel_from_source(name, source)
    numels = {**{p + "numel": n for p, n in k.size_hints.items()}, **k.meta}
    for i, cfg in enumerate(candidates(k.kind, numels)):
        cubin, info, _ = k.compile_for(90, cfg)
        out[f"{path}:{i}"] = (cubin[:4] == b"\\x7fELF", info.num_warps)
print(json.dumps(out))
"""


def test_resnet_layer_kernels_build_for_sm90_in_every_configuration(tmp_path):
    """Both K loops at ResNet-50 sizes (bf16, channels-last): every candidate configuration builds
    for sm_90 on a machine without a GPU (a subprocess, outside the interpreter)."""
    import json
    from pathlib import Path
    layers = {"conv1_flat": ((2, 224, 224, 3), (64, 7, 7, 3), 2, 3), "layer1_taps": ((2, 56, 56, 64), (64, 3, 3, 64), 1, 1)}
    paths = []
    for name, (xs, ws, stride, pad) in layers.items():
        x = stax.randn(*xs).to(stax.bfloat16).permute(0, 3, 1, 2)
        w = stax.randn(*ws).to(stax.bfloat16).permute(0, 3, 1, 2)
        gen = stax.generate(lambda x, w: stax.conv2d(x, w, stride=stride, padding=pad), x, w, device="cuda")
        ((kname, src),) = gen.kernels.items()
        assert ("for t in range(" in src) == name.endswith("taps")
        paths.append(str(tmp_path / f"{name}.json"))
        Path(paths[-1]).write_text(json.dumps([kname, src]))
    built = run_outside_interpreter(SM90_BUILD, *paths)
    assert len(built) >= 10 and all(elf and warps >= 1 for elf, warps in built.values()), built


@pytest.mark.parametrize("channels", [4, 16])
def test_gpu_template_int64_offsets(channels, monkeypatch, rng):
    """Past 2**31 elements the index arithmetic is int64 (both K loops; forced here by a lower limit)."""
    from stax import conv_template
    monkeypatch.setattr(conv_template, "INT32_LIMIT", 1)
    x, w, b = _inputs(rng, (1, channels, 6, 5), (3, 3, 3), 1, True)
    out, gen = _run_gpu(lambda x, w, b: stax.conv2d(x, w, b, padding=1, stride=(1, 2)), x, w, b)
    assert_close(out, direct_conv(f64(x), f64(w), f64(b), (1, 2), _pad4(1)), stax.float32)
    src = gen.kernels["triton_tem_fused_conv_0"]
    assert "'mnumel': 'i64'" in src and "tl.arange(0, BLOCK_K).to(tl.int64)" in src


def test_gpu_template_reads_broadcast_and_sliced_operands_in_place(rng):
    """An expanded input (batch stride 0), a sliced weight (an offset) and a strided bias go to
    the template as views of their buffers: no copy kernel runs before it."""
    x1 = stax.tensor(rng.standard_normal((1, 16, 5, 6)), dtype=stax.float32)
    w_all = stax.tensor(rng.standard_normal((9, 16, 3, 3)), dtype=stax.float32)
    b_all = stax.tensor(rng.standard_normal(12), dtype=stax.float32)
    fn = lambda x, w, b: stax.conv2d(x.expand(3, 16, 5, 6), w[2:7], b[1::2][:5], padding=(2, 1))
    out, gen = _run_gpu(fn, x1, w_all, b_all)
    x = np.broadcast_to(f64(x1), (3, 16, 5, 6))
    assert_close(out, direct_conv(x, f64(w_all)[2:7], f64(b_all)[1::2][:5], padding=_pad4((2, 1))), stax.float32)
    assert list(gen.kernels) == ["triton_tem_fused_conv_0"]
    src = gen.kernels["triton_tem_fused_conv_0"]
    assert "x_row = g * 480" in src and "w_col = 288 + co * 144" in src and "in_ptr2 + (1 + co * 2)" in src


# ---- split-K (issue 14): SPLIT_K a measured candidate; the last split of a tile combines ----


@pytest.fixture
def split_default(monkeypatch, tmp_path):
    """Make the unmeasured default (what Triton's interpreter runs) the split with factor s, at
    test sizes: any K per split (one step is enough), a private cache (an artifact compiled under
    other knobs is not reused); on a real GPU the default runs unmeasured too (STAX_AUTOTUNE=0)."""
    from stax import template_tuning
    monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STAX_AUTOTUNE", "0")
    monkeypatch.setattr(template_tuning, "CONV_SPLIT_DEFAULT_K", 1)
    monkeypatch.setattr(template_tuning, "CONV_SPLIT_MIN_STEPS", 0)

    def use(s):
        monkeypatch.setattr(template_tuning, "CONV_SPLITS", (s,))
    return use


def _run_split(fn, args, s):
    """fn compiled and run on the device; asserts the conv kernel ran with SPLIT_K = s."""
    cf = stax.compile(fn)
    out = cf(*[a.to("cuda") if isinstance(a, stax.Tensor) else a for a in args]).cpu()
    module = cf.artifacts[next(iter(cf.artifacts))][0].__globals__
    (kernel,) = [v for k, v in module.items() if k.startswith("triton_tem_fused_conv")]
    assert kernel.config["SPLIT_K"] == s, kernel.config
    src = cf.last_generated.kernels[kernel.name]
    assert "SPLIT_K : tl.constexpr" in src and "triton_helpers.last_arrival(counts_ptr" in src
    assert "zeroed_workspace_cuda('conv_counts_" in cf.last_generated.wrapper
    return out, src


# split-K's cases: SPLIT_K must divide the K loop's steps, so each has 12 or 24 of them (2, 3, 4 all fit)
SPLIT_CASES = {
    "flat_5x5_s21": ((2, 15, 9, 8), (5, 5, 5), (2, 1), (2, 1), 1, 1, True),          # K 375: 12 steps of 32
    "flat_groups_dil": ((1, 30, 11, 11), (6, 5, 5), 1, 2, (2, 1), 2, False),
    "taps_2x2_pad": ((2, 70, 5, 6), (8, 2, 2), 1, 1, 1, 1, True),                    # 4 taps x 3 blocks of 32
    "taps_groups_dil_s2": ((1, 140, 9, 8), (6, 2, 2), 2, (1, 0), (2, 1), 2, True),
    "taps_1x1": ((1, 360, 4, 5), (4, 1, 1), 1, 0, 1, 1, False),                      # 12 blocks of 32
}


@pytest.mark.parametrize("s", [2, 3, 4])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_gpu_split_k_matches_the_direct_loop(case, s, split_default, rng):
    """Both K loops split 2, 3, 4 ways (K not a multiple of BLOCK_K, odd channel counts), stride,
    padding, dilation, groups, with and without the bias, relu after it."""
    split_default(s)
    xs, ws, stride, pad, dil, groups, bias = SPLIT_CASES[case]
    x, w, b = _inputs(rng, xs, ws, groups, bias)
    kw = dict(stride=stride, padding=pad, dilation=dil, groups=groups)
    if b is None:
        out, src = _run_split(lambda x, w: stax.relu(stax.conv2d(x, w, **kw)), [x, w], s)
    else:
        out, src = _run_split(lambda x, w, b: stax.relu(stax.conv2d(x, w, b, **kw)), [x, w, b], s)
    ref = direct_conv(f64(x), f64(w), None if b is None else f64(b), _pair(stride), _pad4(pad), _pair(dil), groups)
    assert_close(out, np.maximum(ref, 0), stax.float32)
    assert ("for t in range(t_lo, t_lo + PER)" in src) == case.startswith("taps")
    assert ("bias = tl.load" in src) == bias


@pytest.mark.parametrize("s", [2, 3])
def test_gpu_split_k_channels_last_bf16_and_int64(s, split_default, monkeypatch, rng):
    """Channels-last input read in place, split: the tap loop in bf16, the flat loop in float32 with
    int64 offsets (forced by a lower limit)."""
    from stax import conv_template
    split_default(s)
    x_nhwc = stax.tensor(rng.standard_normal((2, 6, 5, 48)), dtype=stax.float32).to(stax.bfloat16)
    w = stax.tensor(rng.standard_normal((16, 48, 3, 3)), dtype=stax.float32).to(stax.bfloat16)
    b = stax.tensor(rng.standard_normal(16), dtype=stax.float32).to(stax.bfloat16)
    x = x_nhwc.to("cuda").permute(0, 3, 1, 2)
    out, _ = _run_split(lambda x, w, b: stax.conv2d(x, w, b, padding=1), [x, w, b], s)
    ref = direct_conv(f64(x_nhwc.permute(0, 3, 1, 2)), f64(w), f64(b), padding=_pad4(1))
    assert out.dtype is stax.bfloat16
    assert_close(out.double(), ref, stax.bfloat16)
    monkeypatch.setattr(conv_template, "INT32_LIMIT", 1)
    x_nhwc = stax.tensor(rng.standard_normal((2, 9, 8, 6)), dtype=stax.float32)
    w = stax.tensor(rng.standard_normal((5, 6, 5, 6)), dtype=stax.float32)        # K 180: 6 steps of 32
    x = x_nhwc.to("cuda").permute(0, 3, 1, 2)
    out, src = _run_split(lambda x, w: stax.conv2d(x, w, stride=2, padding=(0, 1)), [x, w], s)
    assert_close(out, direct_conv(f64(x_nhwc.permute(0, 3, 1, 2)), f64(w), None, (2, 2), _pad4((0, 1))), stax.float32)
    assert "c_k = rk % 6" in src and "split = tl.program_id(2).to(tl.int64) if SPLIT_K > 1 else 0" in src


def _layer4(batch: int):
    x = stax.randn(batch, 7, 7, 512).to(stax.bfloat16).permute(0, 3, 1, 2)
    w = stax.randn(512, 3, 3, 512).to(stax.bfloat16).permute(0, 3, 1, 2)
    return stax.generate(lambda x, w: stax.conv2d(x, w, padding=1), x, w, device="cuda")


def test_split_k_candidates_are_measured_and_the_default_splits_small_grids():
    """ResNet-50's layer4 (batch 32: 52 tiles of 128 x 128 on the H200's 132 SMs) gets SPLIT_K 2 and 4
    candidates beside the unsplit ones (those whose waves keep more SMs busy first: 3's 156 programs
    keep 59% of two waves busy and fall past the limit), the conv's 128-deep K blocks second, the
    default unsplit (64 x 64: 200 tiles); its bfloat16 128 x 256 and 256 x 128 tiles fit shared memory (the
    text's meta carries the element size) and are measured unsplit; at batch 8 the default's 56
    tiles fill under half the SMs, so it splits; layer1 (M = 100352) never splits."""
    from stax.template_tuning import template_tuning_space
    from stax.triton_heuristics import candidates, kernel_from_source
    gen = _layer4(32)
    ((name, src),) = gen.kernels.items()
    assert "SPLIT_K : tl.constexpr" in src and "'SPLIT_K_MAX': 4" in src and "split-K up to 4 (measured)" in src
    assert "buf0_partials = empty_strided_cuda((3211264,), (1,), stax.float32)" in gen.wrapper
    numels = {"bnumel": 1, "mnumel": 1568, "nnumel": 512, "knumel": 512, **kernel_from_source(name, src).meta}
    cands = candidates("template", numels)
    assert cands[0]["SPLIT_K"] == 1 and (cands[0]["BLOCK_M"], cands[0]["BLOCK_N"]) == (64, 64)
    big = {c["SPLIT_K"] for c in cands if (c["BLOCK_M"], c["BLOCK_N"]) == (128, 128)}
    assert big == {1, 2, 4} and len(cands) <= 18
    deep = [(c["BLOCK_N"], c["num_stages"], c["SPLIT_K"]) for c in cands if (c["BLOCK_M"], c["BLOCK_K"]) == (64, 128)]
    assert deep[:2] == [(128, 4, 1), (128, 3, 1)]
    assert cands[1]["BLOCK_K"] == cands[2]["BLOCK_K"] == 128      # a conv's deep-K blocks, measured second
    assert all(c["SPLIT_K"] == 1 for c in cands if (c["BLOCK_M"], c["BLOCK_N"]) == (64, 64))
    assert all((9 * 512 // c["BLOCK_K"]) % c["SPLIT_K"] == 0 for c in cands)     # SPLIT_K divides the steps
    assert template_tuning_space(cands[0], numels)["SPLIT_K"] == [1, 2, 3, 4]
    wide = [c["SPLIT_K"] for c in cands if c["BLOCK_M"] * c["BLOCK_N"] == 128 * 256]
    assert "'itemsize': 2" in src and wide == [1, 1]    # measured unsplit: their combine would spill
    ((name8, src8),) = _layer4(8).kernels.items()
    numels8 = {**numels, "mnumel": 392, **kernel_from_source(name8, src8).meta}
    assert candidates("template", numels8)[0]["SPLIT_K"] == 2
    x = stax.randn(32, 56, 56, 64).to(stax.bfloat16).permute(0, 3, 1, 2)
    w = stax.randn(64, 3, 3, 64).to(stax.bfloat16).permute(0, 3, 1, 2)
    gen1 = stax.generate(lambda x, w: stax.conv2d(x, w, padding=1), x, w, device="cuda")
    assert "SPLIT_K" not in next(iter(gen1.kernels.values())) and "partials" not in gen1.wrapper


SM90_SPLIT_BUILD = """
import json, os, re, subprocess, sys, tempfile
import triton
from stax.triton_heuristics import candidates, kernel_from_source
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
name, source, numels = json.loads(open(sys.argv[1]).read())
k = kernel_from_source(name, source)
out = []
for cfg in candidates(k.kind, {**numels, **k.meta}):
    if cfg["SPLIT_K"] > 1:
        cubin, info, _ = k.compile_for(90, cfg)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
            fh.write(cubin)
            fh.flush()
            usage = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                                   check=True).stdout
        out.append([cfg, {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\\d+)", usage)}])
print(json.dumps(out))
"""


def test_split_k_layer4_builds_for_sm90_without_spills(tmp_path):
    """Every split candidate of ResNet-50's layer4 conv builds for sm_90 (no GPU needed), with no
    registers spilled (cuobjdump's STACK and LOCAL are 0)."""
    import json
    ((name, src),) = _layer4(32).kernels.items()
    path = tmp_path / "layer4.json"
    path.write_text(json.dumps([name, src, {"bnumel": 1, "mnumel": 1568, "nnumel": 512, "knumel": 512}]))
    built = run_outside_interpreter(SM90_SPLIT_BUILD, str(path))
    assert len(built) >= 6 and {cfg["SPLIT_K"] for cfg, _ in built} == {2, 4}
    assert all(use["STACK"] == 0 and use["LOCAL"] == 0 and use["REG"] > 0 for _, use in built), built
