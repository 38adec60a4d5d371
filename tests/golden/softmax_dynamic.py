# triton_per_fused_0: computes to_dtype, amax, sub, exp, sum, div, to_dtype_1
@triton_heuristics.persistent_reduction(size_hints={'x': 8192, 'r0_': 1024}, reduction_hint=ReductionHint.INNER, meta={'even_r0': 1}, signature={'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 's1': 'i32', 'xnumel': 'i32', 'r0_numel': 'i32'})
@triton.jit
def triton_per_fused_0(in_ptr0, out_ptr0, s1, xnumel, r0_numel, XBLOCK : tl.constexpr, EVEN_R0 : tl.constexpr):
    R0_BLOCK: tl.constexpr = 1024
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :] if EVEN_R0 else r0_index < r0_numel
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (r0_1 + x0*s1), r0_mask & xmask, other=0.0)
    tmp1 = tmp0.to(tl.float32)
    tmp2 = tl.broadcast_to(tmp1, [XBLOCK, R0_BLOCK])
    tmp3 = tl.where(r0_mask & xmask, tmp2, float("-inf"))
    tmp4 = triton_helpers.max2(tmp3, 1)[:, None].to(tl.float32)
    tmp5 = (tmp1 - tmp4)
    tmp6 = libdevice.exp(tmp5)
    tmp7 = tl.broadcast_to(tmp6, [XBLOCK, R0_BLOCK])
    tmp8 = tl.where(r0_mask & xmask, tmp7, 0)
    tmp9 = tl.sum(tmp8, 1)[:, None].to(tl.float32)
    tmp10 = (tmp6 / tmp9)
    tmp11 = tmp10.to(tl.float32)
    tl.store(out_ptr0 + (r0_1 + x0*s1), tmp11, r0_mask & xmask)

# triton_red_fused_0: computes to_dtype, amax, sub, exp, sum, div, to_dtype_1
@triton_heuristics.reduction(size_hints={'x': 8192, 'r0_': 8192}, reduction_hint=ReductionHint.INNER, meta={'even_r0': 1}, signature={'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 's1': 'i32', 'xnumel': 'i32', 'r0_numel': 'i32'})
@triton.jit
def triton_red_fused_0(in_ptr0, out_ptr0, s1, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr, EVEN_R0 : tl.constexpr):
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_base = tl.arange(0, R0_BLOCK)[None, :]
    rbase = r0_base
    x0 = xindex
    _tmp0 = tl.full([XBLOCK, 1], -3.4028234663852886e+38, tl.float32)
    _tmp1 = tl.full([XBLOCK, 1], 0, tl.float32)
    r0_whole = r0_numel - r0_numel % R0_BLOCK
    for r0_offset in tl.range(0, r0_whole, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp2 = tl.load(in_ptr0 + (r0_1 + x0*s1), r0_mask & xmask, eviction_policy='evict_last', other=0.0)
        tmp3 = tmp2.to(tl.float32)
        tmp4 = tl.broadcast_to(tmp3, [XBLOCK, R0_BLOCK])
        tmp5 = tl.where(r0_mask & xmask, tmp4, float("-inf"))
        tmp6 = triton_helpers.maximum(_tmp0, triton_helpers.max2(tmp5, 1)[:, None])
        tmp7 = libdevice.exp(_tmp0 - tmp6)
        tmp8 = tl.where(r0_mask & xmask, libdevice.exp(tmp4 - tmp6), 0.0)
        _tmp1 = _tmp1 * tmp7 + tl.sum(tmp8, 1)[:, None]
        _tmp0 = tmp6
    if not EVEN_R0:
        for r0_offset in tl.range(r0_whole, r0_numel, R0_BLOCK):
            r0_index = r0_offset + r0_base
            r0_mask = r0_index < r0_numel
            roffset = r0_offset
            rindex = r0_index
            r0_1 = r0_index
            tmp2 = tl.load(in_ptr0 + (r0_1 + x0*s1), r0_mask & xmask, eviction_policy='evict_last', other=0.0)
            tmp3 = tmp2.to(tl.float32)
            tmp4 = tl.broadcast_to(tmp3, [XBLOCK, R0_BLOCK])
            tmp5 = tl.where(r0_mask & xmask, tmp4, float("-inf"))
            tmp6 = triton_helpers.maximum(_tmp0, triton_helpers.max2(tmp5, 1)[:, None])
            tmp7 = libdevice.exp(_tmp0 - tmp6)
            tmp8 = tl.where(r0_mask & xmask, libdevice.exp(tmp4 - tmp6), 0.0)
            _tmp1 = _tmp1 * tmp7 + tl.sum(tmp8, 1)[:, None]
            _tmp0 = tmp6
    tmp0 = _tmp0
    tmp1 = _tmp1
    r0_whole = r0_numel - r0_numel % R0_BLOCK
    for r0_offset in tl.range(0, r0_whole, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp9 = tl.load(in_ptr0 + (r0_1 + x0*s1), r0_mask & xmask, other=0.0)
        tmp10 = tmp9.to(tl.float32)
        tmp11 = (tmp10 - tmp0)
        tmp12 = libdevice.exp(tmp11)
        tmp13 = (tmp12 / tmp1)
        tmp14 = tmp13.to(tl.float32)
        tl.store(out_ptr0 + (r0_1 + x0*s1), tmp14, r0_mask & xmask, eviction_policy='evict_first')
    if not EVEN_R0:
        for r0_offset in tl.range(r0_whole, r0_numel, R0_BLOCK):
            r0_index = r0_offset + r0_base
            r0_mask = r0_index < r0_numel
            roffset = r0_offset
            rindex = r0_index
            r0_1 = r0_index
            tmp9 = tl.load(in_ptr0 + (r0_1 + x0*s1), r0_mask & xmask, other=0.0)
            tmp10 = tmp9.to(tl.float32)
            tmp11 = (tmp10 - tmp0)
            tmp12 = libdevice.exp(tmp11)
            tmp13 = (tmp12 / tmp1)
            tmp14 = tmp13.to(tl.float32)
            tl.store(out_ptr0 + (r0_1 + x0*s1), tmp14, r0_mask & xmask, eviction_policy='evict_first')


def call(args):
    arg0_1, = args
    args.clear()
    s0 = arg0_1.shape[0]
    s1 = arg0_1.shape[1]
    assert_size_stride(arg0_1, (s0, s1), (s1, 1), 'input')
    with stax.cuda.device(0):
        buf2 = empty_strided_cuda((s0, s1), (s1, 1), stax.float32)
        raw_stream0 = get_raw_stream(0)
        multi_kernel_0.run(arg0_1, buf2, s1, s0, s1, stream=raw_stream0)
        del arg0_1
    return (buf2, )
