# triton_red_fused_0: computes sum
@triton_heuristics.reduction(size_hints={'x': 4096, 'r0_': 128}, reduction_hint=ReductionHint.OUTER, signature={'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'r0_numel': 'i32'})
@triton.jit
def triton_red_fused_0(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    xnumel = 4096
    r0_numel = 128
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    xmask = xindex < xnumel
    r0_base = tl.arange(0, R0_BLOCK)[:, None]
    rbase = r0_base
    x1 = xindex % 512
    x0 = (xindex // 512)
    _tmp0 = tl.full([R0_BLOCK, XBLOCK], 0, tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_2 = r0_index
        tmp1 = tl.load(in_ptr0 + (512*r0_2 + 65536*x0 + x1), r0_mask & xmask, other=0.0)
        tmp2 = tl.broadcast_to(tmp1, [R0_BLOCK, XBLOCK])
        tmp3 = (_tmp0 + tmp2)
        _tmp0 = tl.where(r0_mask & xmask, tmp3, _tmp0)
    tmp0 = tl.sum(_tmp0, 0)[None, :]
    tl.store(out_ptr0 + (512*x0 + x1), tmp0, xmask)

# triton_per_fused_1: computes sum
@triton_heuristics.persistent_reduction(size_hints={'x': 512, 'r0_': 8}, reduction_hint=ReductionHint.OUTER, signature={'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'r0_numel': 'i32'})
@triton.jit
def triton_per_fused_1(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 512
    r0_numel = 8
    R0_BLOCK: tl.constexpr = 8
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[:, None]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[:, None]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (512*r0_1 + x0), xmask, other=0.0)
    tmp1 = tl.broadcast_to(tmp0, [R0_BLOCK, XBLOCK])
    tmp2 = tl.where(xmask, tmp1, 0)
    tmp3 = tl.sum(tmp2, 0)[None, :].to(tl.float32)
    tl.store(out_ptr0 + (x0), tmp3, xmask)
