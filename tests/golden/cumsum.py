# triton_per_fused_0: computes mul, add, cumsum
@triton_heuristics.persistent_reduction(size_hints={'x': 64, 'r0_': 1024}, reduction_hint=ReductionHint.INNER, signature={'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'r0_numel': 'i32'})
@triton.jit
def triton_per_fused_0(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 64
    r0_numel = 1000
    R0_BLOCK: tl.constexpr = 1024
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = r0_index < r0_numel
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (r0_1 + 1000*x0), r0_mask & xmask, other=0.0)
    tmp1 = tl.full([1, 1], 2.0, tl.float32)
    tmp2 = (tmp0 * tmp1)
    tmp3 = tl.full([1, 1], 1.0, tl.float32)
    tmp4 = (tmp2 + tmp3)
    tmp5 = tl.broadcast_to(tmp4, [XBLOCK, R0_BLOCK])
    tmp6 = triton_helpers.cumsum(tmp5, 1)
    tl.store(out_ptr0 + (r0_1 + 1000*x0), tmp6, r0_mask & xmask)
