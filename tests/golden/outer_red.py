# triton_red_fused_0: computes sum
@triton_heuristics.reduction(size_hints={'x': 128, 'r0_': 1024}, reduction_hint=ReductionHint.OUTER, signature={'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'r0_numel': 'i32'})
@triton.jit
def triton_red_fused_0(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    xnumel = 96
    r0_numel = 1000
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    xmask = xindex < xnumel
    r0_base = tl.arange(0, R0_BLOCK)[:, None]
    rbase = r0_base
    x0 = xindex
    _tmp0 = tl.full([R0_BLOCK, XBLOCK], 0, tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp1 = tl.load(in_ptr0 + (96*r0_1 + x0), r0_mask & xmask, eviction_policy='evict_first', other=0.0)
        tmp2 = tl.broadcast_to(tmp1, [R0_BLOCK, XBLOCK])
        tmp3 = (_tmp0 + tmp2)
        _tmp0 = tl.where(r0_mask & xmask, tmp3, _tmp0)
    tmp0 = tl.sum(_tmp0, 0)[None, :]
    tl.store(out_ptr0 + (x0), tmp0, xmask)
